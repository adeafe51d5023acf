"""The pull connector halves from Python: a prefill and a decode worker in one process,
driven through their schedulers the way an engine drives them."""

import gc
import itertools
import json
import time
import weakref
from typing import Any

import numpy as np
import pytest
from conftest import pattern

import kvxfer

_ids = itertools.count()
LAYERS, HEADS, HEAD_DIM, TOKENS, BLOCKS = 2, 4, 16, 4, 16


def regions(kind: str) -> int:
    return {"split-kv": 2 * LAYERS, "cross-layer": 1}.get(kind, LAYERS)


def block_len(kind: str, head_dim: int = HEAD_DIM) -> int:
    # K and V share a slot in a packed cache; a cross-layer block holds every layer's page.
    slot = 1 if kind == "split-kv" else 2
    pages = LAYERS if kind == "cross-layer" else 1
    return pages * HEADS * TOKENS * head_dim * slot * 2  # f16


def cache(kind: str, seed: int | None, head_dim: int = HEAD_DIM) -> list[np.ndarray]:
    n = BLOCKS * block_len(kind, head_dim)
    return [
        pattern(n, seed + r) if seed is not None else np.zeros(n, dtype=np.uint8)
        for r in range(regions(kind))
    ]


def worker(
    role: str,
    transport: str,
    kind: str,
    arrays: list[np.ndarray],
    layout: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
    **settings: Any,
) -> tuple[kvxfer.PullWorker, str]:
    """A TP-1 worker over `arrays` (one per region); returns it and its engine id. `layout`
    overrides keys of the cache's layout dict, `options` of its connector options (a free
    side-channel port by default), `settings` the worker's other keywords."""
    engine = f"{role}{next(_ids)}"
    desc: dict[str, Any] = dict(
        kind=kind,
        order="HND",
        dtype="f16",
        num_layers=LAYERS,
        kv_heads=HEADS,
        head_dim=HEAD_DIM,
        tokens_per_block=TOKENS,
        num_blocks=BLOCKS,
        bases=[int(a.__array_interface__["data"][0]) for a in arrays],
        total_kv_heads=HEADS,
        total_layers=LAYERS,
    )
    desc.update(layout or {})
    opts: dict[str, Any] = {"side_channel_port": 0, **(options or {})}
    args: dict[str, Any] = dict(engine_id=engine, tp_rank=0, tp_size=1, options=json.dumps(opts))
    args.update(settings)
    return kvxfer.PullWorker(f"{engine}-0", transport, desc, **args), engine


def poll(w: kvxfer.PullWorker, want: str, side: int) -> tuple[list[str], list[str], list[Any]]:
    """Polls `w` until `want` is in list `side` of get_finished (0 sending, 1 recving)."""
    seen: tuple[list[str], list[str], list[Any]] = ([], [], [])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        f = w.get_finished()
        for i in range(3):
            seen[i].extend(f[i])  # type: ignore[arg-type]
        if want in seen[side]:
            return seen
        time.sleep(0.002)
    raise AssertionError(f"{want} never finished: {seen}")


def hand_off(
    prefill: kvxfer.PullWorker, engine_id: str, remote: list[int]
) -> tuple[kvxfer.PullScheduler, str]:
    port = prefill.listener_port()
    assert port
    sched = kvxfer.PullScheduler(engine_id, "127.0.0.1", port)
    delay, params = sched.request_finished(
        "r1", json.dumps({"do_remote_decode": True}), True, remote
    )
    assert delay and params is not None
    prefill.start_load_kv(sched.build_step_meta())
    return sched, params


@pytest.mark.parametrize("kind", ["split-kv", "packed-kv", "cross-layer"])
def test_decode_pulls_the_prefill_blocks(transport: str, kind: str) -> None:
    src, dst = cache(kind, 10), cache(kind, None)
    p, p_engine = worker("P", transport, kind, src)
    d, _ = worker("D", transport, kind, dst)
    remote, local = [3, 9], [1, 2]
    _, params = hand_off(p, p_engine, remote)
    dsched = kvxfer.PullScheduler("D", "127.0.0.1", 0)
    assert dsched.tokens_to_load("d-r1", params, 8, 0) == (8, True)
    assert dsched.tokens_to_load("d-r2", None, 8, 0) == (0, False)
    # The decode knows the request under its own id; notes to the prefill name the prefill's.
    assert json.loads(params)["remote_request_id"] == "r1"
    updated = dsched.after_alloc("d-r1", params, local, 8)
    assert json.loads(updated)["do_remote_prefill"] is False
    d.start_load_kv(dsched.build_step_meta())
    _, recving, failed = poll(d, "d-r1", 1)
    assert failed == []
    bl = block_len(kind)
    for s, t in zip(src, dst, strict=True):
        for rb, lb in zip(remote, local, strict=True):
            assert np.array_equal(t[lb * bl : (lb + 1) * bl], s[rb * bl : (rb + 1) * bl])
        untouched = np.ones(len(t), dtype=bool)
        for lb in local:
            untouched[lb * bl : (lb + 1) * bl] = False
        assert not t[untouched].any(), "bytes outside the requested blocks were written"
    # The prefill frees the blocks once the decode's read-done note arrived.
    poll(p, "r1", 0)
    m = d.take_metrics()
    assert m["transfers"] >= 1 and m["bytes"] == len(src) * 2 * bl
    assert d.take_metrics()["transfers"] == 0, "metrics reset on read"
    d.shutdown()
    p.shutdown()


def test_a_second_load_of_a_request_in_flight_is_refused() -> None:
    src, dst = cache("split-kv", 30), cache("split-kv", None)
    p, p_engine = worker("P", "loopback", "split-kv", src)
    d, _ = worker("D", "loopback", "split-kv", dst)
    _, params = hand_off(p, p_engine, [5])
    dsched = kvxfer.PullScheduler("D", "127.0.0.1", 0)
    dsched.after_alloc("r1", params, [6], 4)
    step = dsched.build_step_meta()
    assert d.start_load_kv(step) == []
    assert d.start_load_kv(step) == ["a load of request r1 is already in flight"]
    _, recving, failed = poll(d, "r1", 1)
    assert (recving, failed) == (["r1"], [])
    assert d.take_metrics()["refused_loads"] == 1
    d.shutdown()
    p.shutdown()


def test_incompatible_prefill_fails_the_load_naming_the_mismatch() -> None:
    src, dst = cache("split-kv", 20, head_dim=8), cache("split-kv", None)
    p, p_engine = worker("P", "loopback", "split-kv", src, {"head_dim": 8})
    d, _ = worker("D", "loopback", "split-kv", dst)
    _, params = hand_off(p, p_engine, [0])
    dsched = kvxfer.PullScheduler("D", "127.0.0.1", 0)
    dsched.after_alloc("r1", params, [4], 4)
    d.start_load_kv(dsched.build_step_meta())
    _, recving, failed = poll(d, "r1", 1)
    assert len(failed) == 1
    req, blocks, reason, policy = failed[0]
    assert (req, blocks, policy) == ("r1", [4], "fail")
    assert "head dim" in reason, reason
    assert not any(a.any() for a in dst)
    d.shutdown()
    p.shutdown()


def test_failure_policy_reaches_the_report() -> None:
    # No prefill listens on this port: the handshake fails, the blocks are reported.
    dst = cache("split-kv", None)
    d, _ = worker(
        "D",
        "loopback",
        "split-kv",
        dst,
        options={"handshake_timeout": 0.5},
        failure_policy="recompute",
    )
    dsched = kvxfer.PullScheduler("D", "127.0.0.1", 0)
    params = json.dumps(
        {
            "do_remote_prefill": True,
            "remote_block_ids": [1, 2],
            "remote_engine_id": "nobody",
            "remote_host": "127.0.0.1",
            "remote_port": 9,
        }
    )
    dsched.after_alloc("r1", params, [5, 6], 8)
    d.start_load_kv(dsched.build_step_meta())
    _, _, failed = poll(d, "r1", 1)
    assert [(f[0], f[1], f[3]) for f in failed] == [("r1", [5, 6], "recompute")]
    d.shutdown()


def test_an_idle_wait_returns_with_the_load_and_bad_waits_raise() -> None:
    src, dst = cache("split-kv", 50), cache("split-kv", None)
    p, p_engine = worker("P", "loopback", "split-kv", src)
    d, _ = worker("D", "loopback", "split-kv", dst)
    for bad in (-0.1, float("nan"), float("inf"), 1.5):
        with pytest.raises(kvxfer.InvalidArgumentError):
            d.get_finished(wait=bad)
    t = time.monotonic()
    assert d.get_finished(wait=1.0) == ([], [], []), "nothing outstanding"
    assert time.monotonic() - t < 0.9, "waited with nothing outstanding"
    _, params = hand_off(p, p_engine, [5])
    dsched = kvxfer.PullScheduler("D", "127.0.0.1", 0)
    dsched.after_alloc("r1", params, [6], 4)
    assert d.start_load_kv(dsched.build_step_meta()) == []
    seen: list[str] = []
    deadline = time.monotonic() + 60
    while not seen and time.monotonic() < deadline:
        seen = d.get_finished(wait=1.0)[1]
    assert seen == ["r1"]
    freed: list[str] = []
    while not freed and time.monotonic() < deadline:
        freed = p.get_finished(wait=1.0)[0]
    assert freed == ["r1"], "the prefill's wait ends with the decode's note"
    d.shutdown()
    p.shutdown()


def test_bad_worker_arguments_raise() -> None:
    good = cache("split-kv", None)
    with pytest.raises(kvxfer.LayoutError):
        worker("X", "loopback", "split-kv", good[:3])  # one base short
    with pytest.raises(kvxfer.LayoutError):
        worker("X", "loopback", "sideways", good)
    with pytest.raises(kvxfer.LayoutError):
        worker("X", "loopback", "split-kv", good, {"dtype": "f13"})
    with pytest.raises(kvxfer.LayoutError):
        worker("X", "loopback", "split-kv", good, {"num_blocks": 0})
    with pytest.raises(kvxfer.InvalidMemoryError):
        worker("X", "loopback", "split-kv", good, {"bases": [8, 8, 8, 8]})
    small = [np.zeros(100, dtype=np.uint8) for _ in range(4)]
    with pytest.raises(kvxfer.InvalidMemoryError):
        worker("X", "loopback", "split-kv", small, {"num_blocks": 1 << 20})  # regions overrun
    with pytest.raises(kvxfer.InvalidArgumentError):
        worker("X", "loopback", "split-kv", good, failure_policy="pray")
    with pytest.raises(kvxfer.InvalidArgumentError):
        worker("X", "loopback", "split-kv", good, options={"lease": -1.0})
    with pytest.raises(kvxfer.InvalidArgumentError, match="layerwise"):
        worker("X", "loopback", "split-kv", good, options={"layerwise": True})
    with pytest.raises(kvxfer.InvalidArgumentError):
        worker("X", "loopback", "split-kv", good, tp_rank=1)
    with pytest.raises(kvxfer.NotSupportedError):
        worker("X", "pigeon", "split-kv", good)


def test_bad_scheduler_input_and_step_metadata_raise() -> None:
    s = kvxfer.PullScheduler("S", "127.0.0.1", 5600)
    for junk in ["", "[]", "{", '{"do_remote_prefill": "yes"}', "x" * 100]:
        with pytest.raises(kvxfer.InvalidArgumentError):
            s.tokens_to_load("r", junk, 8, 0)
    with pytest.raises(kvxfer.InvalidArgumentError):
        s.after_alloc("r", json.dumps({"do_remote_prefill": True}), [1], 4)  # fields missing
    assert s.request_finished("r", None, True, [1]) == (False, None)
    assert s.request_finished("r", json.dumps({"do_remote_decode": True}), False, [1]) == (
        False,
        None,
    )
    d, _ = worker("D", "loopback", "split-kv", cache("split-kv", None))
    for junk in ["", "{}x", '{"recv": 5}', '{"recv": [{"req_id": 1}], "hold": []}']:
        with pytest.raises(kvxfer.InvalidArgumentError):
            d.start_load_kv(junk)
    d.start_load_kv(s.build_step_meta())  # an empty step is fine
    d.shutdown()
    d.shutdown()
    for call in [
        lambda: d.get_finished(),
        lambda: d.start_load_kv(s.build_step_meta()),
        lambda: d.take_metrics(),
        lambda: d.listener_port(),
    ]:
        with pytest.raises(kvxfer.ShutDownError):
            call()


def test_arrays_given_as_bases_live_as_long_as_the_worker() -> None:
    """Arrays handed over as region bases are kept by the worker that registered and
    advertises them: dropped by the caller, they are not freed while a peer may read them,
    and they go with the worker. An array smaller than a region is refused."""
    arrays = cache("split-kv", seed=3)
    refs = [weakref.ref(a) for a in arrays]
    w, _ = worker("keep", "loopback", "split-kv", arrays, {"bases": list(arrays)})
    del arrays
    gc.collect()
    assert all(r() is not None for r in refs), "freed while registered"
    w.shutdown()
    del w
    gc.collect()
    assert all(r() is None for r in refs), "kept past the worker"
    short = cache("split-kv", seed=None)
    short[1] = short[1][:-1]
    with pytest.raises(kvxfer.InvalidArgumentError, match="exceeds the object's"):
        worker("keep-short", "loopback", "split-kv", short, {"bases": list(short)})
