"""SGLang's own KV pools, without servers, for what SGLang 0.5.23's CPU engine cannot run here.

- MLA: the CPU engine runs DeepSeek's attention only on its AMX kernels (``intel_amx``); with
  ``torch_native`` a tiny DeepSeek-V2 fails its first prefill (the latent cache's 576 columns
  reach SDPA as keys), and this machine has no AMX.
- Tensor parallelism: at ``--tp-size 2`` the CPU engine builds a NCCL communicator for its
  CPU device (``init_model_parallel_group`` asks only out-of-tree platforms whether they
  support NCCL) and the scheduler dies at start, whatever the transfer backend.

So each case builds the pools SGLang builds (``MLATokenToKVPool``, ``MHATokenToKVPool``, on
CPU), reads them as SGLang hands them to a transfer backend (``get_contiguous_buf_infos``),
describes them with ``kvxfer.sglang.layout.describe`` as the backend does, and moves a room
with the backend's push core (``kvxfer.PushPrefill`` per prefill rank, ``kvxfer.PushDecode``
per decode rank, one registry): the bytes are compared in the decode pools' own tensors.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
torch = pytest.importorskip("torch")
memory_pool = pytest.importorskip("sglang.srt.mem_cache.memory_pool")

import kvxfer  # noqa: E402
from kvxfer.sglang.layout import describe  # noqa: E402

PAGE, PAGES, LAYERS = 16, 8, 2
# The tiny DeepSeek-V2's latent: 512 + 64 floats per token and layer.
KV_LORA_RANK, ROPE_DIM = 512, 64
HEADS, HEAD_DIM = 2, 16
SUCCESS = 4  # SGLang's KVPoll.Success
_rooms = itertools.count(1)


def _seeded(pool_tensors: list[Any], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in pool_tensors:
        t.copy_(torch.randn(t.shape, generator=g))


def mla_pool(seed: int | None) -> Any:
    pool = memory_pool.MLATokenToKVPool(
        size=PAGES * PAGE,
        page_size=PAGE,
        dtype=torch.float32,
        kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=ROPE_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    if seed is not None:
        _seeded(list(pool.kv_buffer), seed)
    return pool


def mha_pool(heads: int, seed: int | None) -> Any:
    pool = memory_pool.MHATokenToKVPool(
        size=PAGES * PAGE,
        page_size=PAGE,
        dtype=torch.float32,
        head_num=heads,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    if seed is not None:
        _seeded([*pool.k_buffer, *pool.v_buffer], seed)
    return pool


def buffers(pool: Any, *, is_mla: bool, kv_heads: int, total_kv_heads: int) -> Any:
    """The pool as SGLang's ``KVArgs`` carry it, described as kvxfer.sglang does."""
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    args = SimpleNamespace(
        page_size=PAGE,
        kv_data_ptrs=ptrs,
        kv_data_lens=lens,
        kv_item_lens=items,
        aux_data_ptrs=[],
        aux_data_lens=[],
        aux_item_lens=[],
        state_types=[],
    )
    return describe(
        args, is_mla=is_mla, kv_heads=kv_heads, total_kv_heads=total_kv_heads, total_layers=LAYERS
    )


class Fleet:
    """A prefill instance (registry and ranks) and a decode instance's ranks."""

    def __init__(self, transport: str, prefill: list[Any], decode: list[Any]) -> None:
        self.registry = kvxfer.PushRegistry()
        n = next(_rooms)
        self.prefill = [
            kvxfer.PushPrefill(
                f"pool-p{n}-{r}",
                transport,
                b.layout,
                registry=("127.0.0.1", self.registry.port),
                tp_rank=r,
                tp_size=len(prefill),
            )
            for r, b in enumerate(prefill)
        ]
        self.decode = [
            kvxfer.PushDecode(f"pool-d{n}-{r}", transport, b.layout, tp_rank=r, tp_size=len(decode))
            for r, b in enumerate(decode)
        ]

    def move(self, src_pages: list[int], dst_pages: list[int]) -> int:
        """One room: every decode rank asks for `dst_pages`, every prefill rank sends
        `src_pages`; returns the room once both sides succeeded."""
        room = 1000 + next(_rooms)
        for d in self.decode:
            d.add_room(room, ("127.0.0.1", self.registry.port), dst_pages)
        self.until(lambda: all(p.destinations_ready(room) for p in self.prefill))
        for p in self.prefill:
            p.add_room(room, len(src_pages))
            p.send(room, src_pages)
        self.until(lambda: all(h.status(room) == SUCCESS for h in [*self.prefill, *self.decode]))
        return room

    def until(self, cond: Any, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "timed out"
            for h in [*self.prefill, *self.decode]:
                h.poll()
            time.sleep(0.002)

    def close(self) -> None:
        for h in [*self.prefill, *self.decode, self.registry]:
            h.shutdown()


@pytest.fixture(params=["loopback", "ucx"])
def transport(request: pytest.FixtureRequest) -> Iterator[str]:
    try:
        kvxfer.Agent(f"pool-probe-{os.getpid()}", request.param).shutdown()
    except kvxfer.NotAvailableError as e:
        pytest.skip(f"{request.param}: {e}")
    yield request.param


def tokens(pages: list[int]) -> list[int]:
    """The pool rows (token slots) of `pages`."""
    return [p * PAGE + t for p in pages for t in range(PAGE)]


SRC, DST = [1, 5, 2], [7, 3, 6]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 2), (2, 1)])
def test_an_mla_pool_reaches_every_decode_rank_whole(
    transport: str, prefill_tp: int, decode_tp: int
) -> None:
    # MLA's latent is the same on every rank: each prefill rank holds the same bytes.
    src = [mla_pool(seed=3) for _ in range(prefill_tp)]
    dst = [mla_pool(seed=None) for _ in range(decode_tp)]
    kw = dict(is_mla=True, kv_heads=1, total_kv_heads=1)
    fleet = Fleet(transport, [buffers(p, **kw) for p in src], [buffers(p, **kw) for p in dst])
    try:
        fleet.move(SRC, DST)
        written = [int(p.take_metrics()["kv_bytes"]) for p in fleet.prefill]
    finally:
        fleet.close()
    room_bytes = len(SRC) * LAYERS * src[0].kv_buffer[0][:PAGE].nbytes
    # One writer per decode rank: a rank's latent comes from one prefill rank, not from each.
    assert sum(written) == decode_tp * room_bytes, written
    for d in dst:
        for layer in range(LAYERS):
            got, want = d.kv_buffer[layer], src[0].kv_buffer[layer]
            assert torch.equal(got[tokens(DST)], want[tokens(SRC)]), f"layer {layer}"
            others = [r for r in range(got.shape[0]) if r not in set(tokens(DST))]
            assert not got[others].any(), "rows outside the room were written"


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 2), (2, 1)])
def test_an_mha_pool_lands_each_head_on_the_rank_that_holds_it(
    transport: str, prefill_tp: int, decode_tp: int
) -> None:
    # The model's cache, head by head; SGLang gives rank r of n heads [r*H/n, (r+1)*H/n).
    whole = mha_pool(HEADS, seed=11)

    def shard(n: int, seed: bool) -> list[Any]:
        per = HEADS // n
        pools = []
        for r in range(n):
            p = mha_pool(per, seed=None)
            if seed:
                for mine, full in zip(
                    [*p.k_buffer, *p.v_buffer], [*whole.k_buffer, *whole.v_buffer], strict=True
                ):
                    mine.copy_(full[:, r * per : (r + 1) * per])
            pools.append(p)
        return pools

    src, dst = shard(prefill_tp, True), shard(decode_tp, False)

    def bufs(pools: list[Any]) -> list[Any]:
        per = HEADS // len(pools)
        return [buffers(p, is_mla=False, kv_heads=per, total_kv_heads=HEADS) for p in pools]

    fleet = Fleet(transport, bufs(src), bufs(dst))
    try:
        fleet.move(SRC, DST)
    finally:
        fleet.close()
    per = HEADS // decode_tp
    for r, d in enumerate(dst):
        for got, full in zip(
            [*d.k_buffer, *d.v_buffer], [*whole.k_buffer, *whole.v_buffer], strict=True
        ):
            want = full[:, r * per : (r + 1) * per]
            assert torch.equal(got[tokens(DST)], want[tokens(SRC)]), f"decode rank {r}"
            others = [t for t in range(got.shape[0]) if t not in set(tokens(DST))]
            assert not got[others].any(), "rows outside the room were written"
