"""Tensor parallelism in the real engine: a TP 2 prefill and a TP 2 decode with the kvxfer
backend over UCX, and the UCX pair's TP 1 servers beside them, give TP 2 → 2, 1 → 2 and
2 → 1. Each decode rank gets its heads from the prefill ranks holding them; every decode
checks content digests (each rank recomputes what landed in its own KV pages against what
the prefill ranks that wrote them digested); outputs equal the plain TP 1 run's, alone and
concurrently; the negative control (prompt A on the prefill, B on the decode under one room)
continues A.

SGLang's CPU engine runs TP 2 here with two settings of its own: ``SGLANG_NCCL_SO_PATH``
pointing at no library (its NCCL communicator then switches itself off, as on a machine
without NCCL; the CPU all-reduce goes through torch.distributed) and
``SGLANG_CPU_OMP_THREADS_BIND`` (one core per rank: this machine has one NUMA node).

Named to run before ``test_sglang_push.py``: the UCX pair it borrows is then started once
for both modules."""

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import HEARTBEAT, PROMPTS, STARTUP, Pair, _usable_or_skip
from harness import (
    PROMPT_A,
    PROMPT_B,
    Server,
    assert_matches,
    direct,
    free_port,
    wait_healthy,
)

TP2 = {
    "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2",
    "SGLANG_CPU_OMP_THREADS_BIND": "0|1",
}


@dataclass
class Tp2:
    prefill: Server
    decode: Server


@pytest.fixture(scope="module")
def tp2(logdir: Path, reference: dict) -> Iterator[Tp2]:
    _usable_or_skip("ucx")
    boot = free_port()
    args = ("--tp-size", "2")
    prefill = Server(
        "prefill",
        "0,1",
        logdir,
        transport="ucx",
        bootstrap_port=boot,
        env=TP2,
        args=args,
        name="prefill-tp2",
    )
    decode = Server(
        "decode",
        "0,1",
        logdir,
        transport="ucx",
        bootstrap_port=boot,
        env={**HEARTBEAT, **TP2, "KVXFER_DIGEST": "1"},
        args=args,
        name="decode-tp2",
    )
    try:
        wait_healthy([prefill, decode], STARTUP)
        yield Tp2(prefill, decode)
    finally:
        decode.close()
        prefill.close()


def _pairs_as_a_plain_run(prefill: Server, decode: Server, reference: dict) -> None:
    """Each prompt alone, then all concurrently, prefill → decode under one room, equal the
    plain run; prompt A on the prefill and B on the decode continues A."""
    p, d = direct(prefill, decode, PROMPT_A, PROMPT_B, random.getrandbits(63))
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    assert d.json()["output_ids"] == reference[tuple(PROMPT_A)]["output_ids"], "negative control"
    for ids in (PROMPT_A, PROMPT_B):
        p, d = direct(prefill, decode, ids, ids, random.getrandbits(63))
        assert d.status_code == 200, d.text
        assert_matches(d.json(), reference[tuple(ids)])
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(
            pool.map(
                lambda ids: direct(prefill, decode, ids, ids, random.getrandbits(63))[1], PROMPTS
            )
        )
    for ids, r in zip(PROMPTS, replies, strict=True):
        assert r.status_code == 200, r.text
        assert_matches(r.json(), reference[tuple(ids)])


def test_tp2_to_tp2_equals_a_plain_run(tp2: Tp2, reference: dict) -> None:
    for rank in (0, 1):
        assert f"prefill rank {rank}/2 over ucx" in tp2.prefill.log_text()
        assert f"decode rank {rank}/2 over ucx" in tp2.decode.log_text()
    assert "content digests checked" in tp2.decode.log_text()
    _pairs_as_a_plain_run(tp2.prefill, tp2.decode, reference)


@pytest.mark.parametrize("pair", ["ucx"], indirect=True)
def test_tp1_to_tp2_equals_a_plain_run(tp2: Tp2, pair: Pair, reference: dict) -> None:
    """The UCX pair's TP 1 prefill writes into the TP 2 decode: each decode rank takes half
    of the prefill's heads."""
    _pairs_as_a_plain_run(pair.prefill, tp2.decode, reference)


@pytest.mark.parametrize("pair", ["ucx"], indirect=True)
def test_tp2_to_tp1_equals_a_plain_run(tp2: Tp2, pair: Pair, reference: dict) -> None:
    """The TP 2 prefill writes into the UCX pair's TP 1 decode (which checks content
    digests): both prefill ranks write their heads into each page."""
    assert "content digests checked" in pair.decode.log_text()
    _pairs_as_a_plain_run(tp2.prefill, pair.decode, reference)
