"""The push connector from Python: a registry, a prefill rank and a decode rank in one
process, driven the way kvxfer.sglang drives them."""

import gc
import itertools
import time
import weakref
from typing import Any

import numpy as np
import pytest
from conftest import pattern

import kvxfer

_ids = itertools.count()
LAYERS, HEADS, HEAD_DIM, BLOCKS = 2, 2, 8, 16
BLOCK = HEADS * HEAD_DIM * 2  # one token per page, f16
AUX_ROW, AUX_ROWS = 16, 8


def addr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


class Rank:
    """One rank's KV regions and two aux buffers, seeded or zero."""

    def __init__(self, seed: int | None) -> None:
        def buf(n: int, s: int) -> np.ndarray:
            return pattern(n, s) if seed is not None else np.zeros(n, dtype=np.uint8)

        self.kv = [buf(BLOCKS * BLOCK, (seed or 0) + r) for r in range(2 * LAYERS)]
        self.aux = [buf(AUX_ROWS * AUX_ROW, (seed or 0) + 100 + i) for i in range(2)]

    def layout(self, **kw: Any) -> dict[str, Any]:
        d: dict[str, Any] = dict(
            kind="split-kv",
            order="nhd",
            dtype="f16",
            num_layers=LAYERS,
            kv_heads=HEADS,
            head_dim=HEAD_DIM,
            tokens_per_block=1,
            num_blocks=BLOCKS,
            bases=[addr(a) for a in self.kv],
            total_kv_heads=HEADS,
            total_layers=LAYERS,
        )
        d.update(kw)
        return d

    def aux_list(self) -> list[tuple[int, int, int]]:
        return [(addr(a), AUX_ROW, AUX_ROWS) for a in self.aux]

    def page(self, region: int, page: int) -> bytes:
        return self.kv[region][page * BLOCK : (page + 1) * BLOCK].tobytes()


def ranks(transport: str, **decode_kw: Any) -> tuple[Any, ...]:
    """Registry, prefill, decode (`decode_kw` added to its arguments), source and
    destination memory."""
    n = next(_ids)
    src, dst = Rank(seed=7 * n + 1), Rank(seed=None)
    registry = kvxfer.PushRegistry()
    prefill = kvxfer.PushPrefill(
        f"pp{n}",
        transport,
        src.layout(),
        registry=("127.0.0.1", registry.port),
        tp_rank=0,
        tp_size=1,
        aux=src.aux_list(),
    )
    decode = kvxfer.PushDecode(
        f"pd{n}",
        transport,
        dst.layout(),
        tp_rank=0,
        tp_size=1,
        aux=dst.aux_list(),
        **decode_kw,
    )
    return registry, prefill, decode, src, dst


def until(cond: Any, *halves: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        for h in halves:
            h.poll()
        time.sleep(0.002)


def test_a_room_moves_its_pages_and_aux_row_in_chunks(transport: str) -> None:
    registry, prefill, decode, src, dst = ranks(transport)
    room = 2**62 + 5
    assert prefill.status(room) is None and not prefill.destinations_ready(room)
    decode.add_room(room, ("127.0.0.1", registry.port), [3, 1, 2], aux_index=5)
    until(lambda: prefill.destinations_ready(room), prefill, decode)
    assert prefill.status(room) == 1, "sized by the engine only now"
    prefill.add_room(room, 3, aux_index=2)
    assert prefill.status(room) == 2
    prefill.send(room, [0, 4])
    assert decode.status(room) in (1, 2, 3)
    prefill.send(room, [7])
    until(lambda: decode.status(room) == 4 and prefill.status(room) == 4, prefill, decode)
    for region in range(2 * LAYERS):
        for s, d in ((0, 3), (4, 1), (7, 2)):
            assert dst.page(region, d) == src.page(region, s)
        assert dst.page(region, 0) == bytes(BLOCK), "a page outside the room"
    for a in range(2):
        assert dst.aux[a][5 * AUX_ROW : 6 * AUX_ROW].tobytes() == (
            src.aux[a][2 * AUX_ROW : 3 * AUX_ROW].tobytes()
        )
        assert not dst.aux[a][: 5 * AUX_ROW].any()
    m = prefill.take_metrics()
    assert m["registrations"] == 1 and m["kv_bytes"] == 3 * 2 * LAYERS * BLOCK
    assert prefill.take_metrics()["kv_bytes"] == 0, "reset on read"
    for h in (prefill, decode, registry):
        h.shutdown()


def test_out_of_range_pages_fail_the_room_on_both_sides_and_nothing_is_written(
    transport: str,
) -> None:
    registry, prefill, decode, src, dst = ranks(transport)
    decode.add_room(9, ("127.0.0.1", registry.port), [0, BLOCKS], aux_index=1)
    until(lambda: prefill.status(9) == 0, prefill, decode)
    assert "out of range" in (prefill.error(9) or "")
    assert not prefill.destinations_ready(9)
    prefill.add_room(9, 2, aux_index=0)
    with pytest.raises(kvxfer.InvalidArgumentError, match="Failed"):
        prefill.send(9, [0, 1])
    until(lambda: decode.status(9) == 0, prefill, decode)
    assert all(not a.any() for a in dst.kv + dst.aux)
    for h in (prefill, decode, registry):
        h.shutdown()


def test_a_decode_whose_model_differs_fails_its_room_at_once_naming_the_difference(
    transport: str,
) -> None:
    # Twice the prefill's model heads, two decode ranks of two heads each: consistent on its
    # own, but no prefill rank could write what it expects.
    registry, prefill, decode, src, dst = ranks(transport)
    decode.shutdown()
    decode = kvxfer.PushDecode(
        f"pd-heads{next(_ids)}",
        transport,
        dst.layout(total_kv_heads=2 * HEADS),
        tp_rank=0,
        tp_size=2,
        aux=dst.aux_list(),
    )
    start = time.monotonic()
    decode.add_room(11, ("127.0.0.1", registry.port), [1, 2], aux_index=1)
    until(lambda: decode.status(11) == 0, prefill, decode, timeout=10)
    assert time.monotonic() - start < 5, "failed at once, not at a timeout"
    error = decode.error(11) or ""
    assert "refused" in error and f"total KV heads: local {HEADS}, remote {2 * HEADS}" in error
    assert prefill.refused() == 1
    assert prefill.status(11) is None, "the prefill never heard of the room"
    assert all(not a.any() for a in dst.kv + dst.aux)
    for h in (prefill, decode, registry):
        h.shutdown()


def test_the_state_indices_sent_with_the_last_chunk_are_used() -> None:
    src, dst = Rank(seed=3), Rank(seed=None)
    state_src, state_dst = pattern(4 * 32, 9), np.zeros(4 * 32, dtype=np.uint8)
    registry = kvxfer.PushRegistry()
    prefill = kvxfer.PushPrefill(
        "ps",
        "loopback",
        src.layout(),
        registry=("127.0.0.1", registry.port),
        tp_rank=0,
        tp_size=1,
        aux=src.aux_list(),
        state=[(addr(state_src), 32, 4)],
        state_kind="mamba",
    )
    decode = kvxfer.PushDecode(
        "ds",
        "loopback",
        dst.layout(),
        tp_rank=0,
        tp_size=1,
        aux=dst.aux_list(),
        state=[(addr(state_dst), 32, 4)],
        state_kind="mamba",
    )
    decode.add_room(1, ("127.0.0.1", registry.port), [5], aux_index=0, state_indices=[3])
    until(lambda: prefill.destinations_ready(1), prefill, decode)
    prefill.add_room(1, 1, aux_index=0)
    prefill.send(1, [2], state_indices=[1])
    until(lambda: decode.status(1) == 4, prefill, decode)
    assert state_dst[3 * 32 : 4 * 32].tobytes() == state_src[32:64].tobytes()
    assert not state_dst[:96].any()
    with pytest.raises(kvxfer.InvalidArgumentError):
        prefill.send(1, [], state_indices=[0])  # a final room
    for h in (prefill, decode, registry):
        h.shutdown()


def test_bad_arguments_raise_and_a_shut_down_rank_refuses_calls() -> None:
    r = Rank(seed=None)
    registry = kvxfer.PushRegistry()
    reg = ("127.0.0.1", registry.port)

    def prefill(**kw: Any) -> kvxfer.PushPrefill:
        args: dict[str, Any] = dict(registry=reg, tp_rank=0, tp_size=1)
        args.update(kw)
        layout = args.pop("layout", r.layout())
        return kvxfer.PushPrefill(f"bad{next(_ids)}", "loopback", layout, **args)

    with pytest.raises(kvxfer.InvalidArgumentError, match="unknown key"):
        prefill(layout=r.layout(kv_head=2))
    with pytest.raises(kvxfer.InvalidArgumentError, match="missing"):
        prefill(layout={k: v for k, v in r.layout().items() if k != "num_blocks"})
    with pytest.raises(kvxfer.LayoutError, match="regions"):
        prefill(layout=r.layout(bases=[addr(r.kv[0])]))
    with pytest.raises(kvxfer.InvalidMemoryError):
        prefill(layout=r.layout(bases=[8, 16, 24, 32]))
    with pytest.raises(kvxfer.InvalidMemoryError):
        prefill(aux=[(8, 16, 4)])
    with pytest.raises(kvxfer.InvalidArgumentError, match="overflows"):
        prefill(aux=[(2**64 - 8, 16, 4)])
    with pytest.raises(kvxfer.InvalidArgumentError, match="state_kind"):
        prefill(state_kind="ssm")
    with pytest.raises(kvxfer.InvalidArgumentError, match="state_kind none"):
        prefill(state=[(addr(r.aux[0]), 16, 4)])
    with pytest.raises(kvxfer.InvalidArgumentError, match="tp_rank"):
        prefill(tp_rank=1)
    with pytest.raises(kvxfer.InvalidArgumentError, match="seconds"):
        prefill(bootstrap_timeout=0)
    with pytest.raises(kvxfer.SideChannelError, match="registry"):
        prefill(registry=("127.0.0.1", 1))
    with pytest.raises(kvxfer.InvalidArgumentError, match="max_heartbeat_failures"):
        kvxfer.PushDecode(
            "d", "loopback", r.layout(), tp_rank=0, tp_size=1, max_heartbeat_failures=0
        )
    p = prefill()
    with pytest.raises(kvxfer.InvalidArgumentError, match="unknown room"):
        p.send(5, [0])
    with pytest.raises(OverflowError):
        p.send(5, [-1])
    p.shutdown()
    p.shutdown()
    with pytest.raises(kvxfer.ShutDownError):
        p.status(5)
    registry.shutdown()


def test_arrays_given_as_buffers_live_as_long_as_the_rank() -> None:
    """Arrays handed over as KV bases and aux buffers are kept by the rank that registered
    them: dropped by the caller, they are not freed while the rank may write into them or
    advertise them, and they go with the rank. An array smaller than its region is refused."""
    dst = Rank(seed=None)
    layout = dst.layout(bases=list(dst.kv))
    aux = [(a, AUX_ROW, AUX_ROWS) for a in dst.aux]
    refs = [weakref.ref(a) for a in dst.kv + dst.aux]
    decode = kvxfer.PushDecode("keep-d", "loopback", layout, tp_rank=0, tp_size=1, aux=aux)
    del dst, layout, aux
    gc.collect()
    assert all(r() is not None for r in refs), "freed while registered"
    decode.shutdown()
    del decode
    gc.collect()
    assert all(r() is None for r in refs), "kept past the rank"
    small = Rank(seed=None)
    short = np.zeros(AUX_ROW * AUX_ROWS - 1, dtype=np.uint8)
    with pytest.raises(kvxfer.InvalidArgumentError, match="exceeds the object's"):
        kvxfer.PushDecode(
            "keep-short",
            "loopback",
            small.layout(bases=list(small.kv)),
            tp_rank=0,
            tp_size=1,
            aux=[(short, AUX_ROW, AUX_ROWS)],
        )
    small.kv[0] = small.kv[0][:-1]
    with pytest.raises(kvxfer.InvalidArgumentError, match="exceeds the object's"):
        kvxfer.PushDecode(
            "keep-short2", "loopback", small.layout(bases=list(small.kv)), tp_rank=0, tp_size=1
        )
