"""Which blocks of each KV cache group a push room moves, for KvxferPushConnector with a
hybrid or sliding-window model (vLLM's hybrid KV cache manager), free of vLLM (so that it is
tested without an engine).

vLLM lists a request's blocks per group by position: block `p` holds tokens `p * block ..`,
and a sliding-window group lists the null block (id 0) where it freed blocks no window
reads any more, always before the others. Both engines of a hand-off compute, or load, the
same tokens, so a group's blocks pair by position: the decode names, per group, the blocks
it must receive (those from its own cached prefix on, its nulls left out), all ending at the
block of the last loaded token; the prefill writes its blocks at the same positions. A
state group (Mamba beside attention) holds one running state per request instead: its one
page, the last block before vLLM's speculative-decoding slots (`scratch` of them), moves
whole, wherever each side keeps it.
"""

from __future__ import annotations

from collections.abc import Sequence


def state_page(ids: Sequence[int], scratch: int) -> list[int]:
    """A state group's page holding the request's running state: the last of its blocks
    (null blocks left out) before the `scratch` speculative slots; none before vLLM
    allocated any."""
    held = [b for b in ids if b != 0]
    if not held:
        return []
    keep = len(held) - min(scratch, len(held) - 1)
    return held[keep - 1 : keep]


def decode_pages(
    groups: Sequence[Sequence[int]],
    first: int,
    end: int,
    scratch: Sequence[int | None] | None = None,
) -> tuple[list[int], list[int]]:
    """The decode's pages of a room and how many are each group's: of each attention
    group's blocks (by position), those at positions `first .. end` (past the blocks its own
    prefix cache holds, up to the last loaded token's), without the null blocks of freed
    out-of-window ones; of a state group (`scratch[g]` not None), its state page. Raises
    ValueError when a group lists fewer blocks, or a null block after a real one (a list
    vLLM never makes), or a state group has no page."""
    pages: list[int] = []
    counts: list[int] = []
    for g, ids in enumerate(groups):
        spare = scratch[g] if scratch is not None else None
        if spare is not None:
            page = state_page(ids, spare)
            if not page:
                raise ValueError(f"KV cache group {g}: no state page allocated")
            pages.extend(page)
            counts.append(1)
            continue
        if len(ids) < end:
            raise ValueError(f"KV cache group {g}: {len(ids)} blocks, the prompt needs {end}")
        span = list(ids[first:end])
        held = _after_nulls(span)
        if 0 in held:
            raise ValueError(f"KV cache group {g}: a null block among its blocks {span}")
        pages.extend(held)
        counts.append(len(held))
    return pages, counts


def prefill_pages(
    groups: Sequence[Sequence[int]],
    counts: Sequence[int],
    end: int,
    scratch: Sequence[int | None] | None = None,
) -> list[int]:
    """The prefill's pages for a decode that takes `counts[g]` pages of group `g`: each
    attention group's blocks at the positions the decode's are (the `counts[g]` ending at
    block `end`), a state group's state page, group after group. Raises ValueError when the
    counts do not fit (another number of groups, more pages than blocks, a state group not
    taken as one page) or a position holds a null block: this prefill freed a block that
    decode expects (it would receive another request's bytes)."""
    if len(counts) != len(groups):
        raise ValueError(
            f"the decode names {len(counts)} KV cache groups, this engine has {len(groups)}"
        )
    pages: list[int] = []
    for g, (ids, n) in enumerate(zip(groups, counts, strict=True)):
        spare = scratch[g] if scratch is not None else None
        if spare is not None:
            page = state_page(ids, spare)
            if n != 1 or not page:
                raise ValueError(
                    f"KV cache group {g}: the decode takes {n} state pages, this prefill "
                    f"holds {len(page)}"
                )
            pages.extend(page)
            continue
        if n > end or end > len(ids):
            raise ValueError(
                f"KV cache group {g}: the decode takes {n} blocks ending at block {end}, "
                f"this prefill holds {len(ids)}"
            )
        span = list(ids[end - n : end])
        if 0 in span:
            raise ValueError(
                f"KV cache group {g}: the decode takes blocks {end - n}..{end}, which this "
                "prefill freed"
            )
        pages.extend(span)
    return pages


def _after_nulls(ids: list[int]) -> list[int]:
    start = next((i for i, b in enumerate(ids) if b != 0), len(ids))
    return ids[start:]
