"""KvxferPushConnector: vLLM's push flow over kvxfer's push core.

The decode is asked first: it allocates the prompt's blocks and opens a *room* for them at the
prefill (``kvxfer.PushDecode.add_room``, through the push registry on the prefill's side
channel port); the prefill computes the prompt and WRITEs its blocks into the room
(``kvxfer.PushPrefill.send``); the decode schedules the request once every prefill rank's
writes landed. It is the flow of vLLM's NixlPushConnector, with kvxfer's rooms, registration
once per peer, heterogeneous TP and failure handling underneath.

The prefill streams: as vLLM computes each attention layer of a step (``save_kv_layer``),
the pages that step completes go out for that layer, for every request whose decode has
asked (pages of earlier steps go whole first), so that the transfer runs behind the rest
of the forward pass and the decode can start once the last layer landed. A layer vLLM did
not report goes when the forward pass ends (``wait_for_save``); a cross-layer cache
(``VLLM_KV_CACHE_LAYOUT=BLHNC``) and a request whose decode asks only after it ended send
whole pages after the step. ``layerwise: false`` turns streaming off; prompts shorter than
``layerwise_min_tokens`` (default 48) are sent whole after their last step instead: on the
benchmark's CPU engine, per-layer posting cost a 32-token prompt's first token more than it
saved and paid from 64 tokens on (docs/vllm.md).

Operators switch to it with ``kv_connector: KvxferPushConnector`` (module ``kvxfer.vllm``);
``kv_connector_extra_config`` takes the pull connector's ``transport``, ``ucx_library``,
``side_channel_host`` and ``side_channel_port`` (the prefill's registry: what a router
passes to the decode as ``remote_host`` / ``remote_port``) and ``idle_wait``, plus
``bootstrap_timeout`` and ``waiting_timeout`` (seconds), ``layerwise`` and
``layerwise_min_tokens``; any other key is refused at start-up, naming it (kvxfer-core's
``options`` defines each key). A router posts the decode first with
``{"do_remote_prefill": true, "remote_host", "remote_port", ...}`` and then the prefill
with ``{"do_remote_decode": true}``, under the same request id (as for NixlPushConnector):
both ends name the room after it, without vLLM's random ``-<8 hex>`` suffix.

Supported today: dense models, and hybrid and sliding-window models (full and
sliding-window attention layers, or Mamba layers beside attention layers, in several KV
cache groups, vLLM's hybrid KV cache manager on), and Mamba models: each attention group's
blocks are written by position into the decode's blocks of that group, a Mamba group's
state page whole (`kvxfer.vllm_groups`), whole pages after the prefill's last step (not
layer by layer); with a sliding window or Mamba state the prefill stops one token short,
which the decode computes itself, so that no block the decode's window reads is freed on
either side and the state holds every token but that one. Mamba state moves between equal
TP sizes only (refused at registration otherwise). Host memory. The decode's
blocks go back to vLLM only once no prefill rank can still write into them (a room aborted
with the request is drained first).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

import kvxfer
from kvxfer.vllm import (
    _HANDED_OFF,
    CacheGroup,
    _held,
    _layer_key,
    cache_groups,
    connector_options,
    describe_engine_cache,
    describe_mixed_cache,
    describe_state_cache,
    drop_last_prompt_token,
    select_transport,
)
from kvxfer.vllm_groups import decode_pages, prefill_pages, state_page
from kvxfer.vllm_stats import KvxferPushPromMetrics, KvxferPushStats, StatsHooks
from kvxfer.vllm_streams import StepPages, Stop, StreamPlan, pages_for

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorStats,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvxfer")

# kvxfer's room states (SGLang's KVPoll values).
_FAILED, _SUCCESS = 0, 4
# vLLM's per-request randomization suffix (`-` and 8 hex digits), which each engine adds.
_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)


def room_of(request_id: str) -> int:
    """The room both engines name a request's hand-off by: its id as the router gave it
    (vLLM's random suffix stripped), hashed to 63 bits."""
    base = _SUFFIX.sub("", request_id)
    return int.from_bytes(hashlib.blake2b(base.encode(), digest_size=8).digest(), "little") >> 1


@dataclass
class PushStepMetadata(KVConnectorMetadata):
    """One scheduler step for the workers. `open`: decode rooms to open (request, room,
    registry host and port, the decode's blocks, prompt tokens its own cache holds, how
    many blocks are each KV cache group's or None for one group); `send`: prefill rooms to
    write, or whose streaming ended (request, room, the prefill's blocks, and in KV cache
    groups each group's blocks by position instead, the prompt's blocks); `abort`: decode
    rooms whose request ended first (request, room); `stream`: the pages prefill requests
    complete in this step, streamed layer by layer; `stop`: prefill rooms to abort
    (request, room, whether the request ended: its blocks are reported once the room
    stopped; a preempted one runs on); `idle`: the step scheduled no token."""

    open: list[tuple[str, int, str, int, list[int], int, list[int] | None]] = field(
        default_factory=list
    )
    send: list[tuple[str, int, list[int], list[list[int]] | None, int]] = field(
        default_factory=list
    )
    abort: list[tuple[str, int]] = field(default_factory=list)
    stream: list[StepPages] = field(default_factory=list)
    stop: list[Stop] = field(default_factory=list)
    idle: bool = False
    taken: bool = False  # a worker took it (vLLM may bind one step's metadata twice)


@dataclass
class _Stream:
    """A prefill room streamed layer by layer on a worker: its request, the prompt's pages
    computed so far, and once its decode asked (`active`) the pages the decode holds
    already (`skip`); until then its pages wait, and go whole when it asks (or when the
    request ends)."""

    req: str
    done: list[int] = field(default_factory=list)
    skip: int = 0
    active: bool = False


@dataclass
class _Job:
    """One step's pages of a streaming room, and the next layer to post."""

    room: int
    pages: list[int]
    next: int = 0


@dataclass
class _Send:
    """A prefill room on a worker: its request and blocks (in KV cache groups: each group's
    blocks by position, in `groups`, and the prompt's block count `end`), when the scheduler
    handed it over (`time.monotonic`); `sent` once its WRITEs posted."""

    req: str
    pages: list[int]
    since: float
    sent: bool = False
    groups: list[list[int]] | None = None
    end: int = 0


class KvxferPushConnector(StatsHooks, KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector for the push flow (the decode asks, the prefill WRITEs)."""

    stats_class = KvxferPushStats
    prom_class = KvxferPushPromMetrics

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: Any = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        opts = connector_options(ktc.kv_connector_extra_config, "push")
        self._extra = opts
        self._engine_id = str(ktc.engine_id)
        self._host = str(opts["side_channel_host"])
        par = vllm_config.parallel_config
        dp = int(getattr(par, "data_parallel_rank_local", 0) or 0)
        self._port = int(opts["side_channel_port"]) + dp
        self._block_size = int(vllm_config.cache_config.block_size)
        self._idle_wait = float(opts["idle_wait"])
        # How long either side waits for the other to show up for a request.
        self._bootstrap_timeout = float(opts["bootstrap_timeout"])
        self._groups: list[CacheGroup] = []
        self._transfer_ids: tuple[int, ...] = (0,)
        if kv_cache_config is not None:
            self._groups = cache_groups(kv_cache_config, self._block_size)
            self._transfer_ids = tuple(kv_cache_config.transfer_group_ids)
        # A sliding window or Mamba state: the prefill stops before the last prompt token,
        # which the decode computes (no block the decode's window reads is freed; a state
        # holds every token it saw). Several groups or a window: each group's blocks move by
        # position (a state group's page whole), whole pages after the step.
        self._sliding = any(g.window is not None for g in self._groups)
        self._state = any(g.state for g in self._groups)
        self._stops_short = self._sliding or self._state
        self._grouped = len(self._groups) > 1 or self._sliding
        # Mamba alone: one state page per request, moved whole.
        self._state_only = self._state and len(self._groups) == 1
        # Per group: a state group's speculative slots, None for attention.
        self._scratch: list[int | None] = [g.scratch if g.state else None for g in self._groups]
        # Scheduler side.
        self._open: list[tuple[str, int, str, int, list[int], int, list[int] | None]] = []
        self._send: list[tuple[str, int, list[int], list[list[int]] | None, int]] = []
        self._abort: list[tuple[str, int]] = []
        self._receiving: dict[str, int] = {}  # decode requests waiting for their room
        self._sending: set[str] = set()  # requests whose blocks wait for a room to end
        self._stop: list[Stop] = []
        # Layer-by-layer streaming (prefill): which requests stream, how far each got.
        self._layerwise = bool(opts["layerwise"])
        self._layerwise_min_tokens = int(opts["layerwise_min_tokens"])
        self._streams_plan = StreamPlan(self._block_size)
        # Worker side.
        self._registry: kvxfer.PushRegistry | None = None
        self._prefill: kvxfer.PushPrefill | None = None
        self._decode: kvxfer.PushDecode | None = None
        self._recv_rooms: dict[int, tuple[str, list[int]]] = {}
        self._send_rooms: dict[int, _Send] = {}
        self._drain_rooms: dict[int, str] = {}
        self._streams: dict[int, _Stream] = {}
        self._jobs: list[_Job] = []
        self._layer_index: dict[str, int] = {}
        self._num_layers = 0
        self._cross_layer = False
        # Posts, by where they were made: layer chunks while the forward pass ran (from
        # `save_kv_layer`) and those left for its end (`wait_for_save`: layers vLLM did not
        # report); whole-page sends of rooms that did not stream, when a step's metadata is
        # bound (before its forward pass) and from the poll after it (a decode that asked late).
        self.posts = {"in_forward": 0, "at_forward_end": 0, "whole_at_bind": 0, "whole_at_poll": 0}
        self._layer_posts_reported = 0

    # ---- scheduler side (EngineCore process) ----

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode") and self._stops_short:
            drop_last_prompt_token(request)
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        count = self._load_end(len(request.prompt_token_ids or [])) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _load_end(self, prompt: int) -> int:
        """The prompt tokens a decode receives: all, or with a sliding window or Mamba
        state all but the last, which it computes (the prefill stopped before it). A
        one-token prompt with state receives nothing: vLLM would compute that token again
        on top of a state that holds it."""
        if self._state:
            return max(prompt - 1, 0)
        return prompt - 1 if self._sliding and prompt > 1 else prompt

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        prompt = len(request.prompt_token_ids or [])
        if (
            params
            and params.get("do_remote_decode")
            and self._layerwise
            and not self._grouped
            and prompt >= max(1, self._layerwise_min_tokens)
        ):
            self._streams_plan.track(request.request_id, room_of(request.request_id), prompt)
        if not params or not params.get("do_remote_prefill"):
            return
        # Once: a preempted request scheduled again computes its prompt itself.
        params["do_remote_prefill"] = False
        if num_external_tokens <= 0:
            return
        loaded = self._load_end(prompt)
        cached = loaded - num_external_tokens
        # The blocks of the tokens the prefill writes: those past the ones cached here.
        first, end = cached // self._block_size, pages_for(loaded, self._block_size)
        counts: list[int] | None = None
        if self._grouped:
            pages = []
            if cached % self._block_size == 0:
                ids = blocks.get_block_ids()
                try:
                    pages, counts = decode_pages(
                        [ids[i] for i in self._transfer_ids], first, end, self._scratch
                    )
                except ValueError as e:
                    log.warning("request %s: %s", request.request_id, e)
            expected = len(pages)
        elif self._state_only:
            pages = state_page(blocks.get_block_ids()[0], self._groups[0].scratch)
            expected = 1
        else:
            held = _held(list(blocks.get_unhashed_block_ids_all_groups()[0]))
            pages = held[: end - first] if cached % self._block_size == 0 else []
            expected = end - first
        host, port = params.get("remote_host"), params.get("remote_port")
        if not pages or len(pages) != expected or not isinstance(port, int) or not host:
            log.warning(
                "request %s: cannot open a push room (registry %r:%r, %d of %d blocks, "
                "%d tokens cached); its load fails",
                request.request_id,
                host,
                port,
                len(pages),
                end - first,
                cached,
            )
            host, port, pages, counts = "", 0, [], None
        room = room_of(request.request_id)
        self._open.append((request.request_id, room, str(host), int(port), pages, cached, counts))
        self._receiving[request.request_id] = room

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PushStepMetadata(
            self._open,
            self._send,
            self._abort,
            self._stream_pages(scheduler_output),
            self._stop,
            idle=scheduler_output.total_num_scheduled_tokens == 0,
        )
        self._open, self._send, self._abort, self._stop = [], [], [], []
        return meta

    def _stream_pages(self, out: SchedulerOutput) -> list[StepPages]:
        """The prompt pages each streaming prefill request completes in this step."""
        if not self._streams_plan:
            return []
        scheduled: list[tuple[str, list[int] | None, int, bool]] = [
            (r.req_id, list(r.block_ids[0]), r.num_computed_tokens, True)
            for r in out.scheduled_new_reqs
        ]
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            resumed = rid in cached.resumed_req_ids
            scheduled.append(
                (rid, None if new is None else list(new[0]), cached.num_computed_tokens[i], resumed)
            )
        steps: list[StepPages] = []
        for rid, blocks, computed, fresh in scheduled:
            n = out.num_scheduled_tokens.get(rid, 0)
            got = self._streams_plan.step(rid, blocks, computed, n, fresh)
            if isinstance(got, Stop):
                self._stop.append(got)
            elif got is not None:
                steps.append(got)
        return steps

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, list(block_ids), None)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if not self._grouped:
            return self._finished(request, list(block_ids[0]), None)
        return self._finished(request, [], [list(block_ids[i]) for i in self._transfer_ids])

    def _finished(
        self, request: Request, block_ids: list[int], groups: list[list[int]] | None
    ) -> tuple[bool, dict[str, Any] | None]:
        """`block_ids`: the request's blocks (one group), or `groups`: each KV cache group's
        blocks by position."""
        rid = request.request_id
        room = self._receiving.pop(rid, None)
        if room is not None:
            # A decode request that ended before its room did: its blocks stay until no
            # prefill rank can write into them any more.
            self._abort.append((rid, room))
            self._sending.add(rid)
            return True, None
        params = request.kv_transfer_params
        may_hand_off, stop = self._streams_plan.finished(rid, request.status in _HANDED_OFF)
        if stop is not None:
            # Ended while its pages were streaming: the room stops, the blocks wait for it.
            self._stop.append(stop)
            self._sending.add(rid)
            return True, None
        if not may_hand_off:
            return False, None  # its stream was cut (preempted): its decode's request failed
        if not params or not params.get("do_remote_decode") or request.status not in _HANDED_OFF:
            return False, None
        n = pages_for(len(request.prompt_token_ids or []), self._block_size)
        if groups is not None:
            # Each attention group's blocks up to the last prompt token's, by position (a
            # state group's page is found when sent).
            attention = [spare is None for spare in self._scratch]
            groups = [g[:n] if a else g for g, a in zip(groups, attention, strict=True)]
            if any(a and len(g) != n for g, a in zip(groups, attention, strict=True)):
                log.warning("request %s: fewer than its %d prompt blocks held", rid, n)
                return False, None
            pages: list[int] = []
        elif self._state_only:
            pages = state_page(block_ids, self._groups[0].scratch)
            if not pages:
                log.warning("request %s: no state page held", rid)
                return False, None
        else:
            pages = _held(list(block_ids))[:n]
            if len(pages) != n:
                log.warning("request %s: %d of its %d prompt blocks held", rid, len(pages), n)
                return False, None
        self._send.append((rid, room_of(rid), pages, groups, n))
        self._sending.add(rid)
        # For the client, as NixlPushConnector answers: what was handed off, and where.
        return True, {
            "kvxfer_room": room_of(rid),
            "remote_block_ids": pages if groups is None else groups,
            "remote_num_tokens": request.num_computed_tokens,
        }

    def has_pending_push_work(self) -> bool:
        return bool(self._sending or self._open or self._send or self._abort or self._stop)

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in connector_output.finished_sending or ():
            self._sending.discard(rid)
        for rid in connector_output.finished_recving or ():
            # Also the end of a request that ended while its room was open: vLLM frees its
            # blocks with this report, and the worker ignores the abort that follows.
            self._receiving.pop(rid, None)
            self._sending.discard(rid)

    # ---- worker side (worker process) ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        cfg = self._vllm_config
        tp_rank, tp_size = (
            get_tensor_model_parallel_rank(),
            cfg.parallel_config.tensor_parallel_size,
        )
        if self._groups:
            # Only the transfer groups' layers move (vLLM rebuilds the others itself).
            moved = {name for g in self._groups for name in g.layers}
            kv_caches = {n: t for n, t in kv_caches.items() if n in moved}
        total_kv_heads = cfg.model_config.get_total_num_kv_heads()
        if self._state_only:
            # Mamba alone: each layer's state pages, one per block. One page per rank: the
            # model's "heads" are its TP ranks.
            layout = describe_state_cache(kv_caches)
            total_kv_heads = tp_size
        elif self._state:
            # Mamba beside attention: the attention cache's description over every layer
            # (their blocks are whole state pages of the same size).
            layout = describe_mixed_cache(kv_caches, self._groups, cfg)
            layout["state_groups"] = [i for i, g in enumerate(self._groups) if g.state]
        else:
            layout = describe_engine_cache(kv_caches, cfg)
        names = sorted(kv_caches, key=_layer_key)
        if self._grouped:
            # Each group's blocks move through its own layers; layers of different groups
            # share memory (vLLM's overlay), registered once.
            index = {n: i for i, n in enumerate(names)}
            layout["groups"] = [sorted(index[n] for n in g.layers) for g in self._groups]
            if self._layerwise:
                log.info(
                    "kvxfer push: %d KV cache groups: pages are written once the prefill "
                    "ends, not layer by layer",
                    len(self._groups),
                )
        self._layer_index = {n: i for i, n in enumerate(names)}
        self._num_layers = len(names)
        self._cross_layer = layout["kind"] == "cross-layer"
        if self._cross_layer and self._layerwise:
            log.info(
                "kvxfer push: a cross-layer cache holds every layer in each block: pages are "
                "written once the prefill ends, not layer by layer"
            )
        layout["total_kv_heads"] = total_kv_heads
        layout["total_layers"] = cfg.model_config.hf_text_config.num_hidden_layers
        transport = select_transport(self._extra)
        e = self._extra
        name = f"{self._engine_id}-push-{tp_rank}"
        self._decode = kvxfer.PushDecode(
            f"{name}-d",
            transport,
            layout,
            tp_rank=tp_rank,
            tp_size=tp_size,
            waiting_timeout=float(e["waiting_timeout"]),
            bootstrap_timeout=self._bootstrap_timeout,
        )
        if tp_rank == 0:
            # The registry decodes ask for this engine's ranks, on the side channel port.
            self._registry = kvxfer.PushRegistry(self._host, self._port)
        deadline = time.monotonic() + 60.0
        while True:
            try:
                self._prefill = kvxfer.PushPrefill(
                    f"{name}-p",
                    transport,
                    layout,
                    registry=(self._host, self._port),
                    tp_rank=tp_rank,
                    tp_size=tp_size,
                    host=self._host,
                    bootstrap_timeout=self._bootstrap_timeout,
                )
                break
            except kvxfer.KvxferError:
                # Rank 0's registry is not up yet (another process).
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        log.info(
            "kvxfer push: rank %d/%d registered %d layers (%s %s, %d blocks), registry %s:%d",
            tp_rank,
            tp_size,
            layout["num_layers"],
            layout["kind"],
            layout["order"],
            layout["num_blocks"],
            self._host,
            self._port,
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # vLLM binds a step's metadata before its forward pass but calls `start_load_kv`
        # after it (unless a load must precede it): the step's work is taken here, so that
        # its layers can be posted as the forward pass computes them.
        if isinstance(connector_metadata, PushStepMetadata) and not connector_metadata.taken:
            connector_metadata.taken = True
            if self._decode is not None:
                self._take_step(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None  # taken when bound (above)

    def _take_step(self, meta: PushStepMetadata) -> None:
        assert self._decode is not None and self._prefill is not None
        for rid, room, host, port, pages, cached, counts in meta.open:
            self._recv_rooms[room] = (rid, pages)
            if not pages:
                continue  # failed in the scheduler: reported at the next poll
            try:
                self._decode.add_room(
                    room, (host, port), pages, prefix_tokens=cached, group_pages=counts
                )
            except kvxfer.KvxferError as e:
                log.warning("kvxfer push: request %s: room refused: %s", rid, e)
                self._recv_rooms[room] = (rid, [])
        now = time.monotonic()
        for stop in meta.stop:
            self._streams.pop(stop.room, None)
            if self._prefill.status(stop.room) is not None:
                self._prefill.abort(stop.room)
            if stop.ended:
                # The request ended: its blocks go back once the room stopped.
                self._send_rooms[stop.room] = _Send(stop.req, [], now, sent=True)
        for sp in meta.stream:
            self._stream_step(sp)
        for rid, room, pages, groups, end in meta.send:
            stream = self._streams.pop(room, None)
            # A streamed room's pages went out with its steps: it only has to end.
            self._send_rooms[room] = _Send(
                rid, pages, now, sent=bool(stream and stream.active), groups=groups, end=end
            )
        # Before this step's forward pass, not after it: the pages of requests that ended
        # (their last step was the one before) go out while this step computes.
        self._post_ready_sends("whole_at_bind")
        for rid, room in meta.abort:
            # A room already reported (done or failed) had its blocks freed by vLLM with the
            # report; only one still open is aborted, and its blocks given back once drained.
            if self._recv_rooms.pop(room, None) is not None:
                self._decode.abort(room)
                self._drain_rooms[room] = rid

    def _stream_step(self, sp: StepPages) -> None:
        """Sets up this step's layer posts of `sp`. A room starts streaming at the first
        step its decode has asked by: the pages earlier steps completed go whole first."""
        assert self._prefill is not None
        pre = self._prefill
        stream = self._streams.setdefault(sp.room, _Stream(sp.req))
        before = len(stream.done)
        stream.done.extend(sp.pages)
        if not stream.active:
            if self._cross_layer or not pre.destinations_ready(sp.room):
                return
            stream.active = True
            stream.skip = pages_for(pre.decode_prefix(sp.room) or 0, self._block_size)
            pre.add_room(sp.room, max(0, sp.total - stream.skip))
            earlier = stream.done[stream.skip : before]
            if earlier:
                try:
                    pre.send(sp.room, earlier)
                except kvxfer.KvxferError as e:
                    log.warning("kvxfer push: room %d: write failed: %s", sp.room, e)
                    return
        pages = stream.done[max(before, stream.skip) :]
        if pages:
            self._jobs.append(_Job(sp.room, pages))

    def _post_layers(self, job: _Job, end: int, counter: str) -> None:
        """Posts layers `job.next .. end` of the job's pages (the last ones complete them)."""
        assert self._prefill is not None
        if end <= job.next:
            return
        try:
            self._prefill.send_layers(
                job.room, job.pages, job.next, end - job.next, end == self._num_layers
            )
            self.posts[counter] += 1
        except kvxfer.KvxferError as e:
            # The room failed in kvxfer; its end is reported as for any failed room.
            log.warning("kvxfer push: room %d: layer write failed: %s", job.room, e)
            end = self._num_layers
        job.next = end

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # vLLM calls this once the layer's KV is in the cache: post it for every request
        # whose pages complete in this step (a layer skipped goes with the next one).
        i = self._layer_index.get(layer_name)
        if i is None:
            return
        for job in self._jobs:
            self._post_layers(job, i + 1, "in_forward")

    def wait_for_save(self) -> None:
        # The forward pass ended: any layer not posted yet goes now.
        for job in self._jobs:
            self._post_layers(job, self._num_layers, "at_forward_end")
        self._jobs = []

    def _post_ready_sends(self, counter: str) -> None:
        """Posts the whole-page sends (rooms that did not stream) whose decode has asked,
        counting each under `counter`."""
        assert self._prefill is not None
        pre = self._prefill
        for room, s in self._send_rooms.items():
            if s.sent or not pre.destinations_ready(room):
                continue
            s.sent = True
            if s.groups is not None:
                # Each group's blocks at the positions of the decode's.
                try:
                    pages = prefill_pages(
                        s.groups, pre.decode_group_pages(room) or [], s.end, self._scratch
                    )
                except ValueError as e:
                    log.warning("kvxfer push: request %s: not sent: %s", s.req, e)
                    pre.abort(room)
                    continue
            else:
                prefix = pages_for(pre.decode_prefix(room) or 0, self._block_size)
                pages = s.pages[prefix:]
            try:
                pre.add_room(room, len(pages))
                pre.send(room, pages)
                self.posts[counter] += 1
            except kvxfer.KvxferError as e:
                log.warning("kvxfer push: request %s: send failed: %s", s.req, e)

    def _progress(self) -> tuple[set[str], set[str], set[str]]:
        """Polls both halves and posts what became ready: (finished sending, finished
        receiving, failed receiving)."""
        assert self._decode is not None and self._prefill is not None
        pre, dec = self._prefill, self._decode
        pre.poll()
        dec.poll()
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        now = time.monotonic()
        self._post_ready_sends("whole_at_poll")
        for room, s in list(self._send_rooms.items()):
            if not s.sent and now - s.since > self._bootstrap_timeout:
                # No decode asked for these blocks: give them back.
                log.warning(
                    "kvxfer push: request %s: no decode opened its room within %.0f s",
                    s.req,
                    self._bootstrap_timeout,
                )
                del self._send_rooms[room]
                sending.add(s.req)
                continue
            status = pre.status(room)
            if s.sent and status is None:
                status = _FAILED  # stopped before its room opened: nothing to wait for
            if status in (_FAILED, _SUCCESS):
                if status == _FAILED and pre.error(room):
                    log.warning("kvxfer push: request %s: %s", s.req, pre.error(room))
                pre.remove_room(room)
                del self._send_rooms[room]
                sending.add(s.req)
        for room, (rid, pages) in list(self._recv_rooms.items()):
            status = dec.status(room) if pages else _FAILED
            if status == _SUCCESS:
                recving.add(rid)
            elif status == _FAILED:
                if pages and not dec.drained(room):
                    # A prefill rank may still write into these blocks: vLLM frees them
                    # with this report, so it waits until every rank stopped.
                    continue
                error = dec.error(room) or "no room opened"
                if "handshake reply" in error or "registry" in error:
                    # What answers at remote_host:remote_port is no kvxfer push registry.
                    error += (
                        " (the prefill named by remote_host/remote_port must run "
                        "KvxferPushConnector: vLLM's NixlPushConnector does not pair with it)"
                    )
                log.warning("kvxfer push: load of %s failed: %s", rid, error)
                # vLLM's way for a failed asynchronous load: in both sets.
                recving.add(rid)
                failed.add(rid)
            else:
                continue
            if pages:
                dec.remove_room(room)
            del self._recv_rooms[room]
        for room, rid in list(self._drain_rooms.items()):
            if dec.drained(room):
                dec.forget(room)
                del self._drain_rooms[room]
                sending.add(rid)
        return sending, recving, failed

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._decode is None:
            return KVConnectorTransferResults()
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        idle = isinstance(meta, PushStepMetadata) and meta.idle
        deadline = time.monotonic() + (self._idle_wait if idle else 0.0)
        sending, recving, failed = self._progress()
        # A step that scheduled nothing exists only to poll us: wait a little for news
        # rather than have vLLM step back-to-back on the cores the transfers use.
        while not (sending or recving) and time.monotonic() < deadline:
            time.sleep(0.001)
            sending, recving, failed = self._progress()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Failed loads are reported per request (`failed_recving`), whole.
        return set()

    # ---- statistics (worker -> front end) ----

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._prefill is None or self._decode is None:
            return None
        m = {**self._decode.take_metrics()}
        pre = self._prefill.take_metrics()
        m.update({k: v for k, v in pre.items() if k != "digest_time"})
        m["bytes"] = pre.get("kv_bytes", 0)
        m["digest_time"] = pre.get("digest_time", 0.0) + m.get("digest_time", 0.0)
        posts = self.posts["in_forward"]
        m["layer_posts"] = posts - self._layer_posts_reported
        self._layer_posts_reported = posts
        stats = self.stats_class.from_worker(m)
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        for part in (self._prefill, self._decode, self._registry):
            if part is not None:
                part.shutdown()
