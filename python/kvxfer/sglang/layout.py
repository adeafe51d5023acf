"""SGLang's ``KVArgs`` as kvxfer's push connector describes a rank's buffers.

SGLang hands a transfer backend flat lists: one KV buffer per layer for K, then one per layer for
V (an MHA pool, ``[pages * page_size, heads, head_dim]`` each, token-major), or one buffer per
layer (an MLA pool, one latent vector per token); ``kv_item_lens`` are the bytes of one page of
each buffer. Aux buffers (``MetadataBuffers``: output ids, logprobs, ...) are rows of
``aux_item_lens`` bytes. State buffers (Mamba, sliding-window) come per state type. This module
turns them into the ``layout`` dict and the buffer triples ``PushPrefill``/``PushDecode`` take,
without importing SGLang, so it is tested on its own.

Bytes are what moves, so the element type is ``u8`` and a head's "dimension" is its bytes per
token: the two sides agree on bytes, and SGLang itself checks that their KV dtypes match.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Buffers = list[tuple[int, int, int]]
"""``(base, item_len, items)`` per buffer."""


class UnsupportedLayout(ValueError):
    """SGLang handed over buffers kvxfer's push connector cannot describe (yet)."""


@dataclass(frozen=True)
class RankBuffers:
    """One rank's buffers as the push connector takes them."""

    layout: dict[str, Any]
    aux: Buffers
    state: Buffers
    state_kind: str


def _rows(ptrs: Sequence[int], lens: Sequence[int], item_lens: Sequence[int]) -> Buffers:
    if not len(ptrs) == len(lens) == len(item_lens):
        raise UnsupportedLayout(
            f"{len(ptrs)} pointers, {len(lens)} lengths and {len(item_lens)} item lengths"
        )
    out: Buffers = []
    for p, n, item in zip(ptrs, lens, item_lens, strict=True):
        if item <= 0 or n < 0 or n % item:
            raise UnsupportedLayout(f"a buffer of {n} bytes does not hold items of {item} bytes")
        out.append((int(p), int(item), int(n) // int(item)))
    return out


def _state(args: Any) -> tuple[Buffers, str]:
    types = [str(getattr(t, "value", t)) for t in (getattr(args, "state_types", None) or [])]
    if not types:
        return [], "none"
    if len(types) != 1 or types[0] not in ("mamba", "swa"):
        raise UnsupportedLayout(f"state types {types}: kvxfer moves one Mamba or SWA state")
    rows = _rows(args.state_data_ptrs[0], args.state_data_lens[0], args.state_item_lens[0])
    return rows, "mamba" if types[0] == "mamba" else "window"


def describe(
    args: Any,
    *,
    is_mla: bool,
    kv_heads: int,
    total_kv_heads: int,
    total_layers: int,
    first_layer: int = 0,
    memory: str = "host",
) -> RankBuffers:
    """The push connector's description of a rank whose ``KVArgs`` are `args`.

    `kv_heads` are this rank's KV heads and `total_kv_heads` the model's (1 and 1 for MLA);
    `first_layer` is the rank's first global layer (pipeline stages); `memory` is ``host`` or
    ``gpu:N``.
    """
    page = int(args.page_size)
    kv = _rows(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens)
    if getattr(args, "num_draft_entries", 0):
        raise UnsupportedLayout("speculative decoding's draft KV buffers are not moved yet")
    if not kv or page <= 0:
        raise UnsupportedLayout("no KV buffers or no page size")
    if len({item for _, item, _ in kv}) != 1 or len({n for _, _, n in kv}) != 1:
        raise UnsupportedLayout("KV buffers of different sizes (a hybrid pool)")
    _, item_len, pages = kv[0]
    heads = 1 if is_mla else kv_heads
    if heads <= 0 or item_len % (page * heads):
        raise UnsupportedLayout(f"{item_len} bytes per page do not split into {heads} heads")
    if is_mla:
        kind, bases, layers = "mla", [b for b, _, _ in kv], len(kv)
    else:
        if len(kv) % 2:
            raise UnsupportedLayout(f"{len(kv)} KV buffers: expected K and V per layer")
        layers = len(kv) // 2
        # SGLang lists K0..K(L-1), V0..V(L-1); kvxfer numbers regions K0, V0, K1, V1, ...
        bases = [kv[i + half][0] for i in range(layers) for half in (0, layers)]
        kind = "split-kv"
    layout = {
        "kind": kind,
        "order": "nhd",
        "dtype": "u8",
        "num_layers": layers,
        "kv_heads": heads,
        "head_dim": item_len // (page * heads),
        "tokens_per_block": page,
        "num_blocks": pages,
        "bases": bases,
        "total_kv_heads": 1 if is_mla else total_kv_heads,
        "total_layers": total_layers,
        "first_layer": first_layer,
        "memory": memory,
    }
    aux = _rows(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)
    state, state_kind = _state(args)
    return RankBuffers(layout, aux, state, state_kind)


def flat_indices(indices: Any) -> list[int]:
    """A numpy array, tensor or sequence of page or state indices as a list of ints."""
    if indices is None:
        return []
    tolist = getattr(indices, "tolist", None)
    values = tolist() if tolist is not None else list(indices)
    return [int(v) for v in values]


def state_indices(per_type: Sequence[Any] | None) -> list[int]:
    """The one state type's indices from SGLang's per-type list (empty without state)."""
    if not per_type:
        return []
    present = [s for s in per_type if s is not None]
    if len(present) > 1:
        raise UnsupportedLayout("more than one state type's indices")
    return flat_indices(present[0]) if present else []
