"""SGLang's disaggregation backend classes, driven by kvxfer's push connector.

SGLang's own machinery stays where the engine relies on it: the manager and the bootstrap server
subclass SGLang's common classes, so the HTTP bootstrap server, its ``/route`` registry, the
decode's parallel-info table and the prefill's rank registration are SGLang's. What a backend
owns runs in kvxfer: the bootstrap server also runs a :class:`kvxfer.PushRegistry` (found at its
``/kvxfer`` route); each prefill rank is a :class:`kvxfer.PushPrefill`, each decode rank a
:class:`kvxfer.PushDecode`. The decode registers its KV, aux and state buffers once per prefill
instance and sends each room's pages; the prefill validates every index against that
registration, WRITEs each chunk as SGLang calls ``send`` and tells the decode when the room is
complete or failed. Sender and receiver subclass SGLang's base classes: the common ones are its
ZMQ control protocol, which kvxfer replaces.

Statuses reach SGLang as its ``KVPoll`` values and never go back (SGLang all-reduces them across
ranks with ``min``): ``Failed`` wins, otherwise a rank reports the highest status it has seen.

Mixed fleets (``KVXFER_TRANSPORT=nixl``): a prefill rank also serves stock SGLang decodes running
SGLang's own nixl backend, whose messages arrive on SGLang's ZMQ socket of the rank
(``PushPrefill.stock_message``); a decode rank whose prefill's bootstrap server has no
``/kvxfer`` route (a stock nixl prefill) speaks SGLang's messages to its ranks itself
(:mod:`kvxfer.sglang.stock`).

Settings (environment): ``KVXFER_TRANSPORT`` (``ucx``, the default, or ``nixl``) and
``KVXFER_UCX_LIBRARY`` (see :mod:`kvxfer.ucx`). SGLang's own ``SGLANG_DISAGGREGATION_*`` timeouts
and heartbeat settings apply. With ``KVXFER_DISCOVERY=etcd://HOST:PORT[,...]`` (on the prefill and
the decode) each prefill rank also registers in that etcd (cluster ``KVXFER_CLUSTER``, default
``default``; engine id ``KVXFER_ENGINE_ID``, default from its registry's address; lease TTL
``KVXFER_LEASE_TTL`` seconds, default 10), and the decode's rooms learn the prefill's ranks ("all
registered") and its liveness from etcd instead of asking its push registry: a dead prefill's
rooms fail once its keys are gone (within the TTL), a restarted one is picked up when it
registers again. The decode still finds the registry's address through SGLang's bootstrap
server, so the prefill must reach its own bootstrap server at the host the decodes are given.

Content digests (the decode's choice; prefills digest when asked): ``KVXFER_DIGEST=1`` on the
decode, or SGLang's own ``--disaggregation-enable-kv-checksum`` on a decode whose KV is in host
memory, checks every room's pages against the content digests of the prefill ranks that wrote
them before the room succeeds; a mismatch fails the room (``KVPoll.Failed``). On a GPU decode
SGLang's flag keeps SGLang's own (CUDA) checksum, and kvxfer's has no device kernel yet.
``KVXFER_DIGEST=0`` switches kvxfer's off whatever the flag says.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import threading
import time
import uuid
from typing import Any, NamedTuple

import zmq
from aiohttp import web
from sglang.srt.disaggregation.base.conn import (
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferDestination,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVManager,
    KVTransferError,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.network import NetworkAddress

import kvxfer
import kvxfer.nixl
import kvxfer.ucx
from kvxfer import _kvxfer as frames
from kvxfer.sglang import bootstrap, stock
from kvxfer.sglang.layout import UnsupportedLayout, describe, flat_indices, state_indices

log = logging.getLogger(__name__)

REGISTRY_ROUTE = "/kvxfer"
"""Where a kvxfer bootstrap server says which port its push registry listens on."""

POLL_INTERVAL = 0.0002
"""Least time between two polls of a rank's connector: every sender and receiver polls."""

REGISTRY_WAIT = 60.0
"""How long a prefill rank waits for its bootstrap server to answer (it may start later)."""

STOCK_POLL_MS = 2
"""How long the stock-decode thread waits on the rank's ZMQ socket between sends of what
stock decodes are told (their room statuses wait at most this long)."""


def _transport() -> str:
    transport = os.environ.get("KVXFER_TRANSPORT", "ucx")
    if transport not in ("ucx", "nixl"):
        raise ValueError(f"KVXFER_TRANSPORT={transport!r}: expected ucx or nixl")
    if transport == "ucx":
        library = kvxfer.ucx.select("auto")
        log.info("kvxfer: UCX %s (%s)", kvxfer.ucx_version(), library or "the system's")
    else:
        log.info("kvxfer: NIXL runtime %s (%s)", *kvxfer.nixl.select())
    return transport


class Discovery(NamedTuple):
    """Where ranks register in etcd (``KVXFER_DISCOVERY`` and its companions)."""

    url: str
    cluster: str
    engine_id: str | None


def _discovery() -> Discovery | None:
    url = os.environ.get("KVXFER_DISCOVERY")
    if not url:
        return None
    return Discovery(
        url,
        os.environ.get("KVXFER_CLUSTER", "default"),
        os.environ.get("KVXFER_ENGINE_ID") or None,
    )


def _digest(server_args: ServerArgs, memory: str) -> bool:
    """Whether a decode checks kvxfer's content digests (``KVXFER_DIGEST``, else SGLang's
    ``--disaggregation-enable-kv-checksum`` on host memory)."""
    raw = os.environ.get("KVXFER_DIGEST", "")
    if raw not in ("", "0", "1"):
        raise ValueError(f"KVXFER_DIGEST={raw!r}: expected 0 or 1")
    if raw:
        return raw == "1"
    flag = bool(getattr(server_args, "disaggregation_enable_kv_checksum", False))
    if flag and memory != "host":
        log.info(
            "kvxfer: --disaggregation-enable-kv-checksum on GPU memory: SGLang's own checksum "
            "checks the KV (kvxfer's content digests have no device kernel yet)"
        )
        return False
    return flag


def _lease_ttl() -> float:
    """``KVXFER_LEASE_TTL`` (a prefill's registration lease), checked."""
    raw = os.environ.get("KVXFER_LEASE_TTL", "10")
    try:
        ttl = float(raw)
    except ValueError:
        ttl = float("nan")
    if not 2.0 <= ttl <= 3600.0:  # NaN too
        raise ValueError(f"KVXFER_LEASE_TTL={raw!r}: expected seconds, 2 to 3600")
    return ttl


def _engine_id(registry: tuple[str, int]) -> str:
    """A prefill engine id from its registry's address, in etcd's key alphabet."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", registry[0])
    return f"sglang-{host}-{registry[1]}"


def _model_config(server_args: ServerArgs) -> Any:
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig.from_server_args(server_args)


def _host_port(url: str) -> tuple[str, int]:
    host, _, port = url.split("//", 1)[1].rpartition(":")
    return host.strip("[]"), int(port)


def _ask_registry(url: str, deadline: float, stock_ok: bool = False) -> tuple[str, int] | None:
    """The push registry's port from a kvxfer bootstrap server at `url`, retried until
    `deadline` (monotonic) while the server is not up yet. Each try is bounded in time and
    size and its reply checked (`kvxfer.sglang.bootstrap`). With `stock_ok`, a bootstrap
    server without the route (a stock SGLang prefill's) gives `None`."""
    host, port = _host_port(url)
    while True:
        try:
            status, body = bootstrap.get(host, port, REGISTRY_ROUTE)
            if status == 200:
                return host, bootstrap.parse_reply(body)
            if status == 404 and stock_ok:
                return None
            reason = f"HTTP {status}: {body[:200]!r}"
        except (OSError, ValueError) as e:
            reason = str(e)
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"kvxfer: no push registry at {url}{REGISTRY_ROUTE} ({reason}); is the prefill "
                "running with --disaggregation-transfer-backend kvxfer?"
            )
        time.sleep(0.5)


class KvxferKVManager(CommonKVManager):
    """One rank's backend state: SGLang's common manager plus a push prefill or decode."""

    supports_deferred_decode_kv_release = True
    """SGLang's decode holds a failed or aborted room's pages until
    :meth:`is_abort_release_safe`: kvxfer's prefill ranks acknowledge an abort once their
    WRITEs of the room were released (or fail the room after releasing them), and a prefill
    declared dead counts as stopped."""

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: ServerArgs,
        is_mla_backend: bool | None = False,
    ) -> None:
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        if self.attn_dp_size > 1 or self.system_dp_size > 1:
            raise UnsupportedLayout("kvxfer moves KV of one data-parallel group (dp_size 1)")
        if self.attn_cp_size > 1 or self.dcp_size > 1:
            raise UnsupportedLayout("kvxfer does not move context-parallel KV")
        if self.pp_size > 1:
            # The push connector writes pipeline stages, but SGLang polls only stage 0's
            # senders and gives a decode no stage layout: not wired up yet.
            raise UnsupportedLayout("kvxfer's SGLang backend moves KV of pp_size 1 only")
        is_mla = bool(is_mla_backend)
        layers = len(args.kv_data_ptrs) if is_mla else len(args.kv_data_ptrs) // 2
        kv_heads, total_heads = self._heads(args, server_args, is_mla)
        memory = "host" if server_args.device == "cpu" else f"gpu:{args.gpu_id}"
        bufs = describe(
            args,
            is_mla=is_mla,
            kv_heads=kv_heads,
            total_kv_heads=total_heads,
            total_layers=layers,
            memory=memory,
        )
        transport = _transport()
        role = "p" if disaggregation_mode == DisaggregationMode.PREFILL else "d"
        name = f"sgl{role}{self.attn_tp_rank}-{uuid.uuid4().hex[:12]}"
        self._last_poll = 0.0
        self.push: kvxfer.PushPrefill | kvxfer.PushDecode
        self.registration: kvxfer.Registration | None = None
        disc = _discovery()
        directory = "push registries"
        if disaggregation_mode == DisaggregationMode.PREFILL:
            registry = _ask_registry(self._bootstrap_url(), time.monotonic() + REGISTRY_WAIT)
            assert registry is not None
            self.push = kvxfer.PushPrefill(
                name,
                transport,
                bufs.layout,
                registry=registry,
                tp_rank=self.attn_tp_rank,
                tp_size=self.attn_tp_size,
                pp_rank=self.pp_rank,
                pp_size=self.pp_size,
                aux=bufs.aux,
                state=bufs.state,
                state_kind=bufs.state_kind,
                host=self.local_ip,
                bootstrap_timeout=float(self.bootstrap_timeout),
            )
            if disc is not None:
                engine_id = disc.engine_id or _engine_id(registry)
                self.registration = self.push.register(
                    disc.url,
                    disc.cluster,
                    engine_id,
                    registry,
                    uuid.uuid4().int & (2**64 - 1),
                    _lease_ttl(),
                )
                directory = f"etcd cluster {disc.cluster!r} as {engine_id!r}"
            if transport == "nixl":
                self._serve_stock_decodes()
                directory += f"; stock SGLang nixl decodes on ZMQ port {self.rank_port}"
        else:
            self.registries: dict[str, tuple[str, int]] = {}
            self.push = kvxfer.PushDecode(
                name,
                transport,
                bufs.layout,
                tp_rank=self.attn_tp_rank,
                tp_size=self.attn_tp_size,
                aux=bufs.aux,
                state=bufs.state,
                state_kind=bufs.state_kind,
                waiting_timeout=float(self.waiting_timeout),
                heartbeat_interval=float(self.heartbeat_interval),
                max_heartbeat_failures=int(self.max_failures),
                discovery=None if disc is None else (disc.url, disc.cluster),
                digest=_digest(server_args, memory),
            )
            if disc is not None:
                directory = f"etcd cluster {disc.cluster!r}"
            if _digest(server_args, memory):
                directory += ", content digests checked"
            self.stock_prefills: set[str] = set()
            self.stock = stock.StockRooms(float(self.waiting_timeout))
            self._stock_args = (args, name, "DRAM" if memory == "host" else "VRAM")
            self._stock_ranks: dict[tuple[str, int], tuple[str, int]] = {}
            self._stock_registered: set[tuple[str, int]] = set()
            self._stock_sockets: dict[tuple[str, int], zmq.Socket] = {}
            # Guards the caches and sockets above: the heartbeat thread forgets prefills.
            self._stock_lock = threading.RLock()
            self._generations = itertools.count(1)
            self._stock_heartbeats: threading.Thread | None = None
            if transport == "nixl":
                threading.Thread(
                    target=self._hear_stock_prefills, name="kvxfer-stock", daemon=True
                ).start()
                directory += f"; stock SGLang nixl prefills answer on ZMQ port {self.rank_port}"
        shape = {k: v for k, v in bufs.layout.items() if k != "bases"}
        shape["aux_item_lens"] = [item for _, item, _ in bufs.aux]
        shape["state_item_lens"] = [item for _, item, _ in bufs.state]
        log.info(
            "kvxfer: %s rank %d/%d over %s, agent %s, prefills through %s; kvxfer-layout: %s",
            disaggregation_mode.value,
            self.attn_tp_rank,
            self.attn_tp_size,
            transport,
            name,
            directory,
            json.dumps(shape, sort_keys=True),
        )

    def _serve_stock_decodes(self) -> None:
        """Stock SGLang decodes (SGLang's own nixl backend) register and name their rooms on
        this rank's ZMQ PULL socket, which SGLang's common manager binds and registers with
        the bootstrap server (kvxfer decodes never use it): a thread of its own reads it and
        pushes back what they are told, so a fleet may mix the two backends."""
        threading.Thread(target=self._stock_loop, name="kvxfer-stock", daemon=True).start()

    def _stock_loop(self) -> None:
        prefill = self.push
        assert isinstance(prefill, kvxfer.PushPrefill)
        sock = self.server_socket
        while True:
            try:
                if sock.poll(STOCK_POLL_MS):
                    frames = sock.recv_multipart()
                    try:
                        prefill.stock_message(frames)
                    except kvxfer.InvalidArgumentError as e:
                        log.warning("kvxfer: refused a stock SGLang decode's message: %s", e)
                for host, port, parts in prefill.take_stock_outbox():
                    to = NetworkAddress(host, port)
                    try:
                        # SGLang's own cached PUSH sockets (a send times out, never hangs).
                        self._send_multipart_locked(to.to_tcp(), parts, is_ipv6=to.is_ipv6)
                    except Exception as e:  # noqa: BLE001 - one decode must not stop the rest
                        log.warning("kvxfer: could not tell stock decode %s: %s", to, e)
            except (kvxfer.ShutDownError, zmq.ContextTerminated):
                return
            except zmq.ZMQError as e:
                if sock.closed:
                    return
                log.warning("kvxfer: stock decode socket: %s", e)
                time.sleep(0.1)

    # Decode side: stock SGLang prefills (SGLang's own nixl backend).

    def _hear_stock_prefills(self) -> None:
        """Reads what stock prefill ranks tell this decode rank on SGLang's PULL socket
        (``KV_STATUS``, ``ABORT_ACK``) into :attr:`stock`."""
        sock = self.server_socket
        while True:
            try:
                parts = sock.recv_multipart()
            except (zmq.ContextTerminated, zmq.ZMQError) as e:
                if sock.closed or isinstance(e, zmq.ContextTerminated):
                    return
                log.warning("kvxfer: stock prefill socket: %s", e)
                time.sleep(0.1)
                continue
            try:
                msg = frames.sglang_nixl_from_prefill(parts)
            except kvxfer.InvalidArgumentError as e:
                log.warning("kvxfer: refused a message on the decode's ZMQ socket: %s", e)
                continue
            if msg[0] == "status":
                _, room, status, rank, reason = msg
                known = self.stock.on_status(room, status, rank, reason)
            else:
                _, room, rank, generation = msg
                known = self.stock.on_ack(room, rank, generation)
            if not known:
                log.info(
                    "kvxfer: %s for room %d from prefill rank %d, not expected", msg[0], room, rank
                )

    def _probe_stock_prefills(self) -> None:
        """Asks each stock prefill's bootstrap server ``/health`` every heartbeat interval, as
        SGLang's decode does: after `max_failures` misses in a row its unfinished rooms fail
        and it is forgotten (the next request bootstraps again, so a restarted one serves it)."""
        misses: dict[str, int] = {}
        interval = max(float(self.heartbeat_interval), 0.5)
        while True:
            time.sleep(interval)
            for addr in list(self.stock_prefills):
                host, port = _host_port(f"http://{addr}")
                try:
                    ok = bootstrap.get(host, port, "/health", timeout=min(interval, 3.0))[0] == 200
                except (OSError, ValueError):
                    ok = False
                misses[addr] = 0 if ok else misses.get(addr, 0) + 1
                if misses[addr] >= int(self.max_failures):
                    misses.pop(addr)
                    reason = f"stock SGLang prefill {addr} missed {self.max_failures} heartbeats"
                    failed = self.stock.prefill_died(addr, reason)
                    log.warning("kvxfer: %s; %d rooms failed", reason, failed)
                    self.forget_prefill(addr)

    @property
    def endpoint(self) -> tuple[str, int]:
        """This rank's PULL socket, where stock prefill ranks answer."""
        return self.local_ip, int(self.rank_port)

    def stock_link(self, bootstrap_addr: str, prefill_tp: int) -> list[tuple[int, tuple[str, int]]]:
        """The stock prefill ranks this decode rank asks for rooms of the prefill at
        `bootstrap_addr` (TP `prefill_tp`), each with its ZMQ endpoint, registered with once.
        Raises :class:`stock.Refused`, OSError or ValueError naming the problem."""
        with self._stock_lock:
            return self._link(bootstrap_addr, prefill_tp)

    def _link(self, bootstrap_addr: str, prefill_tp: int) -> list[tuple[int, tuple[str, int]]]:
        out = []
        for tp in stock.targets(prefill_tp, self.attn_tp_size, self.attn_tp_rank):
            key = (bootstrap_addr, tp)
            if key not in self._stock_ranks:
                host, port = _host_port(f"http://{bootstrap_addr}")
                route = (
                    f"/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank={tp}"
                    "&target_pp_rank=0"
                )
                status, body = bootstrap.get(host, port, route)
                if status != 200:
                    raise ValueError(f"{bootstrap_addr}{route}: HTTP {status}: {body[:200]!r}")
                self._stock_ranks[key] = bootstrap.parse_rank(body)
            endpoint = self._stock_ranks[key]
            if endpoint not in self._stock_registered:
                self.stock_send(endpoint, self._stock_registration())
                self._stock_registered.add(endpoint)
            out.append((tp, endpoint))
        return out

    def _stock_registration(self) -> list[bytes]:
        args, agent, kind = self._stock_args
        ptrs = [int(p) for p in args.kv_data_ptrs]
        items = [int(n) for n in args.kv_item_lens]
        slots = min(int(n) // i for n, i in zip(args.kv_data_lens, items, strict=True))
        state = [list(x or []) for x in (getattr(args, "state_data_ptrs", None) or [])]
        extra: dict[str, Any] = {}
        if state:
            extra = {
                "state_ptrs": [int(p) for p in state[0]],
                "state_item_lens": [int(n) for n in args.state_item_lens[0]],
                "state_data_lens": [int(n) for n in args.state_data_lens[0]],
            }
        return frames.sglang_nixl_registration(
            self.endpoint,
            agent,
            self.decode.native_metadata(),
            ptrs,
            items,
            slots,
            kind,
            [int(p) for p in args.aux_data_ptrs],
            gpu_id=int(getattr(args, "gpu_id", 0) or 0),
            tp=(self.attn_tp_size, self.attn_tp_rank),
            **extra,
        )

    def stock_send(self, endpoint: tuple[str, int], parts: list[bytes]) -> None:
        """Pushes one message to a stock prefill rank, within a second (as SGLang's decode
        does); raises zmq.ZMQError when it cannot, forgetting the socket and where that rank
        was (a restarted prefill's ranks listen elsewhere: the next room asks again)."""
        with self._stock_lock:
            sock = self._stock_sockets.get(endpoint)
            if sock is None:
                sock = self._zmq_ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDTIMEO, 1000)
                sock.setsockopt(zmq.LINGER, 0)
                # Only to a connected rank: a message to one that is gone fails its send
                # instead of waiting in a queue for a rank that never comes back.
                sock.setsockopt(zmq.IMMEDIATE, 1)
                sock.connect(NetworkAddress(*endpoint).to_tcp())
                self._stock_sockets[endpoint] = sock
            try:
                sock.send_multipart(parts)
            except zmq.ZMQError:
                self._stock_sockets.pop(endpoint, None)
                sock.close(linger=0)
                self._stock_registered.discard(endpoint)
                for key in [k for k, v in self._stock_ranks.items() if v == endpoint]:
                    del self._stock_ranks[key]
                raise

    def _heads(self, args: KVArgs, server_args: ServerArgs, is_mla: bool) -> tuple[int, int]:
        """This rank's KV heads and the model's: SGLang fills them in on the prefill; a decode
        reads the model's count and shards it as SGLang does (replicated below one a rank)."""
        if is_mla:
            return 1, 1
        total = int(getattr(args, "total_kv_head_num", 0) or 0)
        per_rank = int(getattr(args, "kv_head_num", 0) or 0)
        if not total:
            total = int(_model_config(server_args).get_total_num_kv_heads())
        if not per_rank:
            per_rank = max(1, total // self.attn_tp_size)
        return per_rank, total

    def _bootstrap_url(self) -> str:
        """The bootstrap server's URL as SGLang's rank registration reaches it."""
        if self.dist_init_addr:
            host = NetworkAddress.parse(self.dist_init_addr).resolved().host
        else:
            host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(
                self.bootstrap_host, self.bootstrap_host
            )
        return NetworkAddress(host, self.bootstrap_port).to_url()

    def tick(self) -> None:
        """Polls the connector, at most every `POLL_INTERVAL`."""
        now = time.monotonic()
        if now - self._last_poll >= POLL_INTERVAL:
            self._last_poll = now
            self.push.poll()

    # Decode side: SGLang's deferred release of an aborted room's pages.

    @property
    def decode(self) -> kvxfer.PushDecode:
        """This decode rank's connector."""
        assert isinstance(self.push, kvxfer.PushDecode), "a prefill rank has no decode"
        return self.push

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """Whether no prefill rank can still write into the room's pages. kvxfer knows which
        ranks were sent them and counts their acknowledgements itself (`required_acks`, the
        count SGLang's own receivers keep, is not needed)."""
        self.tick()
        if bootstrap_room in self.stock:
            return self.stock.drained(int(bootstrap_room))
        return self.decode.drained(int(bootstrap_room))

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        if bootstrap_room in self.stock:
            if not self.stock.drained(int(bootstrap_room)):
                log.warning(
                    "kvxfer: room %d released before its stock prefill ranks acknowledged "
                    "its abort (SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT passed)",
                    bootstrap_room,
                )
            self.stock.forget(int(bootstrap_room))
            return
        decode = self.decode
        if not decode.drained(int(bootstrap_room)):
            log.warning(
                "kvxfer: room %d released before every prefill rank acknowledged its abort "
                "(SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT passed)",
                bootstrap_room,
            )
        decode.forget(int(bootstrap_room))

    # Decode side: which push registry serves a prefill.

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        if not super().try_ensure_parallel_info(bootstrap_addr):
            return False
        if bootstrap_addr in self.registries or bootstrap_addr in self.stock_prefills:
            return True
        try:
            url = f"http://{bootstrap_addr}"
            registry = _ask_registry(url, time.monotonic(), stock_ok=True)
        except RuntimeError as e:
            log.error("%s", e)
            self.prefill_info_table.pop(bootstrap_addr, None)
            return False
        if registry is None:
            # SGLang's own bootstrap server: a stock prefill (its nixl backend, we hope; its
            # ranks say otherwise by not answering).
            log.info("kvxfer: %s is a stock SGLang prefill (no %s route)", url, REGISTRY_ROUTE)
            self.stock_prefills.add(bootstrap_addr)
            if self._stock_heartbeats is None:
                self._stock_heartbeats = threading.Thread(
                    target=self._probe_stock_prefills, name="kvxfer-stock-hb", daemon=True
                )
                self._stock_heartbeats.start()
        else:
            self.registries[bootstrap_addr] = registry
        return True

    def registry(self, bootstrap_addr: str) -> tuple[str, int] | None:
        """The push registry of the prefill at `bootstrap_addr`, once known."""
        return self.registries.get(bootstrap_addr)

    def forget_prefill(self, bootstrap_addr: str) -> None:
        """Drops what is cached about a prefill that may be gone (it may come back with a new
        registry), so the next request asks its bootstrap server again."""
        self.registries.pop(bootstrap_addr, None)
        self.prefill_info_table.pop(bootstrap_addr, None)
        with self._stock_lock:
            self.stock_prefills.discard(bootstrap_addr)
            for key in [k for k in self._stock_ranks if k[0] == bootstrap_addr]:
                self._stock_registered.discard(self._stock_ranks.pop(key))


GONE = ("heartbeats", "registry", "connect", "refused", "timed out", "etcd")
"""Words of the failures after which a decode asks a prefill's bootstrap server again: the
prefill missed heartbeats, its registry or a rank could not be reached, or etcd knew no
(whole) prefill at its registry's address."""


class _Room:
    """A sender's or receiver's room: a status that only rises, failure final."""

    def __init__(self, mgr: KvxferKVManager, bootstrap_room: int | None) -> None:
        self.kv_mgr = mgr
        self.bootstrap_room = int(bootstrap_room or 0)
        self.conclude_state: int | None = None
        self.status: int = KVPoll.Bootstrapping
        self.reason: str | None = None

    def _fail(self, reason: str) -> int:
        if self.conclude_state is None:
            log.warning("kvxfer: room %d failed: %s", self.bootstrap_room, reason)
            self.reason = reason
            self.conclude_state = KVPoll.Failed
            self.status = KVPoll.Failed
        return KVPoll.Failed

    def _rise(self, status: int) -> int:
        if status == KVPoll.Failed:
            return self._fail(self.kv_mgr.push.error(self.bootstrap_room) or "failed")
        self.status = max(self.status, status)
        if self.status == KVPoll.Success:
            self.conclude_state = KVPoll.Success
            self.kv_mgr.push.remove_room(self.bootstrap_room)
        return self.status

    def _release(self) -> None:
        """Ends the room in the connector: its transfers released, its peers told (where it
        had not ended), then forgotten. SGLang calls no ``clear`` after a failure."""
        self.kv_mgr.push.abort(self.bootstrap_room)
        self.kv_mgr.push.remove_room(self.bootstrap_room)

    def failure_exception(self) -> None:
        self._release()
        # No reason of our own: another rank's failure made SGLang fail this one.
        raise KVTransferError(
            self.bootstrap_room,
            self.reason or "failed on another rank",
            is_from_another_rank=self.reason is None,
        )


class KvxferKVSender(_Room, BaseKVSender):
    """A prefill request's room: destinations come from the decode, pages from ``send``."""

    def __init__(
        self,
        mgr: KvxferKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        _Room.__init__(self, mgr, bootstrap_room)
        self.inited = False
        self.created = time.monotonic()
        # As SGLang's own backends measure a transfer: bytes of the pages sent, time from the
        # first send to the poll that sees it complete.
        self.metric = KVTransferMetric(transfer_total_bytes=0)
        self.first_send: float | None = None

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.kv_mgr.push.add_room(
            self.bootstrap_room, int(num_kv_indices), None if aux_index is None else int(aux_index)
        )
        self.inited = True

    def pop_decode_prefix_len(self) -> int:
        """The prompt tokens the decode holds already (its radix cache), which SGLang then
        skips: asked once the decode's destinations arrived (``WaitingForInput``)."""
        return self.kv_mgr.push.decode_prefix(self.bootstrap_room) or 0

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        # An empty last chunk still carries aux and state and completes the room.
        return num_pages > 0 or last_chunk

    def send(
        self,
        kv_indices: Any,
        state_indices: list[Any] | None = None,
        num_kv_tokens: int | None = None,
        **_: Any,
    ) -> None:
        if self.conclude_state is not None:
            return
        if self.first_send is None:
            self.first_send = time.perf_counter()
        try:
            pages = flat_indices(kv_indices)
            self.kv_mgr.push.send(self.bootstrap_room, pages, _state_of(state_indices))
        except (kvxfer.KvxferError, OverflowError, TypeError, ValueError) as e:
            self._fail(str(e))
            return
        self.metric.transfer_total_bytes = (self.metric.transfer_total_bytes or 0) + len(
            pages
        ) * self.kv_mgr.kv_item_lens_sum

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        self.kv_mgr.tick()
        push = self.kv_mgr.push
        status = push.status(self.bootstrap_room)
        if self.inited:
            if status is None:
                return self._fail("the room is gone")
            result = self._rise(status)
            if result == KVPoll.Success and self.first_send is not None:
                self.metric.transfer_latency_s = time.perf_counter() - self.first_send
            return result
        if status == KVPoll.Failed:
            result = self._rise(status)
            push.remove_room(self.bootstrap_room)
            return result
        if push.destinations_ready(self.bootstrap_room):
            return self._rise(KVPoll.WaitingForInput)
        if time.monotonic() - self.created > self.kv_mgr.bootstrap_timeout:
            push.remove_room(self.bootstrap_room)
            return self._fail(f"no decode asked for the room in {self.kv_mgr.bootstrap_timeout} s")
        return self.status

    def poll_pp_consensus(self) -> int:
        return self.poll()

    def get_transfer_metric(self) -> KVTransferMetric:
        return self.metric

    def abort(self) -> None:
        self._fail("aborted by the prefill engine")
        self._release()

    def clear(self) -> None:
        self.kv_mgr.push.remove_room(self.bootstrap_room)


def _state_of(per_type: list[Any] | None) -> list[int] | None:
    return state_indices(per_type) if per_type else None


class KvxferKVReceiver(_Room, BaseKVReceiver):
    """A decode request's room: pages and aux row from ``send_metadata``, data from the
    prefill ranks it maps to."""

    def __init__(
        self,
        mgr: KvxferKVManager,
        bootstrap_addr: str,
        bootstrap_room: int | None = None,
    ) -> None:
        _Room.__init__(self, mgr, bootstrap_room)
        self.bootstrap_addr = bootstrap_addr
        self.registry: tuple[str, int] | None = None
        self.added = False
        # What SGLang's decode reads off every receiver. `abort_notified`: the prefill ranks
        # were told to stop (SGLang then holds the pages until the manager says they are
        # drained); no staging; `bootstrap_infos` is SGLang's count of acknowledgements,
        # which kvxfer keeps itself.
        self.abort_notified = False
        self.require_staging = False
        self.bootstrap_infos: list[dict[str, Any]] = []
        # The ranks of a stock SGLang prefill (its own nixl backend) this room goes to.
        self.stock_ranks: list[tuple[int, tuple[str, int]]] | None = None

    def init(self, prefill_dp_rank: int) -> None:
        info = self.kv_mgr.prefill_info_table.get(self.bootstrap_addr)
        self.registry = self.kv_mgr.registry(self.bootstrap_addr)
        if info is not None and self.bootstrap_addr in self.kv_mgr.stock_prefills:
            self._init_stock(info)
        elif info is None or self.registry is None:
            self._fail(f"no kvxfer prefill known at {self.bootstrap_addr}")
        elif info.dp_size != 1 or info.attn_cp_size != 1:
            self._fail(
                f"the prefill at {self.bootstrap_addr} has dp_size {info.dp_size} and "
                f"attn_cp_size {info.attn_cp_size}; kvxfer moves KV of dp 1, cp 1"
            )
        else:
            self._rise(KVPoll.WaitingForInput)

    def _init_stock(self, info: Any) -> None:
        if info.dp_size != 1 or info.attn_cp_size != 1 or info.pp_size != 1:
            self._fail(
                f"the stock prefill at {self.bootstrap_addr} has dp_size {info.dp_size}, "
                f"attn_cp_size {info.attn_cp_size} and pp_size {info.pp_size}; kvxfer takes KV "
                "from stock prefills of dp 1, cp 1, pp 1"
            )
            return
        try:
            self.stock_ranks = self.kv_mgr.stock_link(self.bootstrap_addr, info.attn_tp_size)
        except (stock.Refused, OSError, ValueError, zmq.ZMQError) as e:
            self._fail(f"stock SGLang prefill at {self.bootstrap_addr}: {e}")
            return
        self._rise(KVPoll.WaitingForInput)

    def _send_stock(
        self, pages: list[int], aux_index: int | None, state: list[int], prefix: int
    ) -> None:
        assert self.stock_ranks is not None
        mgr = self.kv_mgr
        parts = frames.sglang_nixl_room(
            self.bootstrap_room,
            mgr.endpoint,
            mgr._stock_args[1],
            pages,
            aux_index,
            1,
            state,
            prefix,
        )
        # Known before the first send: an answer may come back at once.
        mgr.stock.sent(self.bootstrap_room, self.bootstrap_addr, [tp for tp, _ in self.stock_ranks])
        self.added = True
        for _, endpoint in self.stock_ranks:
            mgr.stock_send(endpoint, parts)

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
        **_: Any,
    ) -> None:
        if self.conclude_state is not None:
            return
        if destination != KVTransferDestination.DEVICE:
            self._fail("kvxfer writes into the decode's device pool only")
            return
        if self.stock_ranks is not None:
            try:
                self._send_stock(
                    flat_indices(kv_indices),
                    None if aux_index is None else int(aux_index),
                    _state_of(state_indices) or [],
                    int(decode_prefix_len or 0),
                )
            except (zmq.ZMQError, OverflowError, TypeError, ValueError) as e:
                self._fail(f"stock SGLang prefill at {self.bootstrap_addr}: {e}")
                self._release()
            return
        if self.registry is None:
            self._fail("send_metadata before init")
            return
        try:
            self.kv_mgr.push.add_room(
                self.bootstrap_room,
                self.registry,
                flat_indices(kv_indices),
                None if aux_index is None else int(aux_index),
                _state_of(state_indices) or [],
                # Tokens its radix cache holds: the pages are for those after them.
                prefix_tokens=int(decode_prefix_len or 0),
            )
        except (kvxfer.KvxferError, OverflowError, TypeError, ValueError) as e:
            self._fail(str(e))
            return
        self.added = True

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        if not self.added:
            return self.status
        if self.stock_ranks is not None:
            return self._poll_stock()
        self.kv_mgr.tick()
        status = self.kv_mgr.push.status(self.bootstrap_room)
        if status is None:
            return self._fail("the room is gone")
        result = self._rise(status)
        if result == KVPoll.Failed:
            self._release()
            if any(w in (self.reason or "") for w in GONE):
                self.kv_mgr.forget_prefill(self.bootstrap_addr)
        return result

    def _poll_stock(self) -> int:
        status, reason = self.kv_mgr.stock.status(self.bootstrap_room)
        if status == KVPoll.Failed:
            self._fail(reason or "failed")
            self._release()
            if any(w in (self.reason or "") for w in GONE):
                self.kv_mgr.forget_prefill(self.bootstrap_addr)
            return KVPoll.Failed
        self.status = max(self.status, status)
        if self.status == KVPoll.Success:
            self.conclude_state = KVPoll.Success
        return self.status

    def _release(self) -> None:
        if self.added and self.stock_ranks is not None:
            # Its prefill ranks are told to stop; SGLang holds the pages until each answered
            # or acknowledged (the manager's `is_abort_release_safe`).
            mgr = self.kv_mgr
            generation = next(mgr._generations)
            ranks = set(mgr.stock.abort(self.bootstrap_room, generation))
            parts = frames.sglang_nixl_abort(self.bootstrap_room, mgr.endpoint, generation)
            for tp, endpoint in self.stock_ranks:
                if tp in ranks:
                    try:
                        mgr.stock_send(endpoint, parts)
                    except zmq.ZMQError as e:
                        log.warning(
                            "kvxfer: abort of room %d not sent to %s: %s",
                            self.bootstrap_room,
                            endpoint,
                            e,
                        )
            self.abort_notified = True
            return
        if self.added:
            # Its prefill ranks are told to stop writing (the connector also tells them
            # of a room it forgets before its bootstrap came back) and acknowledge; the room
            # is kept aside in the connector until they have.
            self.kv_mgr.push.abort(self.bootstrap_room)
            self.kv_mgr.push.remove_room(self.bootstrap_room)
            self.abort_notified = True

    def abort(self) -> None:
        self._fail("aborted by the decode engine")
        self._release()

    def clear(self) -> None:
        if self.added and self.conclude_state != KVPoll.Success:
            self._release()
            if not self.kv_mgr.enable_deferred_decode_kv_release:
                # SGLang releases the pages now (its deferred release is switched off):
                # nothing will ask whether the room drained.
                if self.stock_ranks is not None:
                    self.kv_mgr.stock.forget(self.bootstrap_room)
                else:
                    self.kv_mgr.decode.forget(self.bootstrap_room)
        elif self.added and self.stock_ranks is not None:
            self.kv_mgr.stock.forget(self.bootstrap_room)
        elif self.added:
            self.kv_mgr.push.remove_room(self.bootstrap_room)

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """Tells the prefill ranks to stop (once); a room whose pages never left this rank
        (``send_metadata`` not called or refused) has nobody to tell, and ``abort_notified``
        stays False: SGLang releases its pages at once."""
        if not self.abort_notified:
            self._release()

    def is_abort_release_safe(self) -> bool:
        """For host destinations, which kvxfer refuses (``send_metadata``)."""
        return self.kv_mgr.is_abort_release_safe(self.bootstrap_room, 0)


class KvxferKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's HTTP bootstrap server, plus the prefill instance's push registry, whose port
    it tells at ``/kvxfer``."""

    def __init__(self, host: str, port: int) -> None:
        # The registry must answer wherever SGLang's bootstrap server does (decodes learn its
        # port there and connect to the same host): an empty host is all interfaces to
        # SGLang's server (aiohttp), so it is to the registry too.
        if not host:
            log.warning(
                "kvxfer: SGLang passed an empty bootstrap host, so its bootstrap server and "
                "kvxfer's push registry listen on every interface; set --host to restrict both"
            )
        self.registry = kvxfer.PushRegistry(host or "0.0.0.0", 0)
        super().__init__(host, port)
        log.info("kvxfer: push registry on port %d", self.registry.port)

    def _setup_routes(self) -> None:
        super()._setup_routes()
        self.app.router.add_get(REGISTRY_ROUTE, self._handle_kvxfer)

    async def _handle_kvxfer(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"port": self.registry.port, "instance": str(self.registry.instance)}
        )

    def close(self) -> None:
        super().close()
        self.registry.shutdown()
