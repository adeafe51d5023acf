"""Mixed fleets: a real vLLM engine running its own NixlConnector (stock) and one running
KvxferConnector over NIXL pull KV from each other, each side speaking vLLM 0.32.0's
NixlConnector protocol (version 14). Both engines are `kv_both`: each is the prefill of one
direction and the decode of the other. Leases are 30 s on both, so a read whose notification
did not count would show as an expired lease within the test."""

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import _usable_or_skip
from flows import (
    BLOCK,
    assert_blocks_arrived,
    assert_same_output,
    block_ids,
    decode,
    prefill,
    prompt,
)
from harness import MODEL, STOCK, Engine, close_all, free_port, start

import kvxfer

# Longer than the time from a prefill to its decode's first heartbeat (the decode's ask, a
# first connection), short enough that a lease run out shows within the test (one wait, in
# test_only_the_unread_requests_leases_expire).
LEASE = 30
# The kvxfer engine's bound on a READ; the restart test's first request must end within it.
TRANSFER_TIMEOUT = 10
# How long each hand-off's calls took, for the lease test's messages.
HANDOFFS: list[str] = []
# Each engine has a core of its own, as on hosts of their own. The stock one takes the last
# core: on CPU, NixlConnector moves its worker's main thread there whatever the binding
# (vLLM keeps the last core of each NUMA node for start_load_kv), and that thread spins.
STOCK_CPUS, KVXFER_CPUS = "1", "0"


def _timed(name: str, prefill_then_read: Any) -> Any:
    """Runs a hand-off (`prefill_then_read(mark)`, which calls `mark()` between its prefill
    and its read) and records how long each half took."""
    t0 = time.monotonic()
    marks: list[float] = []
    out = prefill_then_read(lambda: marks.append(time.monotonic()))
    t1 = time.monotonic()
    mid = marks[0] if marks else t1
    HANDOFFS.append(f"{name}: prefill {mid - t0:.1f} s, read {t1 - mid:.1f} s")
    return out


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    """(stock, kvxfer) engines."""
    _usable_or_skip("nixl")
    logdir = tmp_path_factory.mktemp("vllm-mixed")
    stock_port = free_port()
    stock = Engine(
        "stock",
        STOCK_CPUS,
        {"kv_lease_duration": LEASE},
        logdir,
        model=MODEL,
        connector=STOCK,
        env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(stock_port)},
    )
    stock.side_channel_port = stock_port  # type: ignore[attr-defined]
    ours = Engine(
        "kvxfer",
        KVXFER_CPUS,
        {
            "transport": "nixl",
            "side_channel_port": free_port(),
            "lease": LEASE,
            "transfer_timeout": TRANSFER_TIMEOUT,
        },
        logdir,
        model=MODEL,
    )
    engines = start([stock, ours])
    try:
        # A first request on each, so that an engine's first-call costs are not spent from
        # a lease.
        for e in engines:
            _step(e)
        yield engines[0], engines[1]
    finally:
        close_all(engines)
        print(f"engine logs: {logdir}")


def _step(e: Engine) -> None:
    """One local request, so that the engine steps and reports its connector's counters."""
    decode(e, [prompt(99, 8)], [None])


def _expired(stock: Engine, ours: Engine) -> tuple[float, float]:
    s = stock.call({"op": "metrics", "prefix": "vllm:nixl_num_kv_expired"})
    k = ours.call({"op": "metrics", "prefix": "vllm:kvxfer_expired"})
    return sum(s.values()), sum(k.values())


def test_a_kvxfer_decode_pulls_from_a_stock_prefill(mixed: tuple[Engine, Engine]) -> None:
    stock, ours = mixed
    x = prompt(41, 100)
    # Nothing runs between the prefill and the decode, so the lease is not spent on the
    # test's own calls (hashing a cache took up to 29 s on a loaded machine): the decode's
    # state is taken before, the prefill's after (the stock engine runs nothing in between,
    # so the freed blocks still hold what was read).
    before = ours.call({"op": "kv_hashes"})
    external = ours.call({"op": "external_tokens"})

    def handoff(mark: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        (params,) = prefill(stock, [x])
        mark()
        (remote,) = decode(ours, [x], [params])
        return params, remote

    params, remote = _timed("stock -> kvxfer", handoff)
    assert "kvxfer_protocol" not in params and params["transfer_mode"] == "pull", params
    p_blocks = stock.call({"op": "kv_hashes"})
    assert ours.call({"op": "external_tokens"}) - external == len(x)
    after = ours.call({"op": "kv_hashes"})
    assert_blocks_arrived(p_blocks, before, after, block_ids(params)[: len(x) // BLOCK])
    (local,) = decode(ours, [x], [None])
    assert_same_output(remote, local)
    # That the stock prefill counted our read note (it freed the blocks then, not when the
    # lease ran out) is checked by test_only_the_unread_requests_leases_expire.


def test_a_stock_decode_pulls_from_a_kvxfer_prefill(mixed: tuple[Engine, Engine]) -> None:
    stock, ours = mixed
    x = prompt(42, 100)
    before = stock.call({"op": "kv_hashes"})
    external = stock.call({"op": "external_tokens"})

    def handoff(mark: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        (params,) = prefill(ours, [x])
        mark()
        (remote,) = decode(stock, [x], [params])
        return params, remote

    params, remote = _timed("kvxfer -> stock", handoff)
    assert params["kvxfer_protocol"] and params["transfer_mode"] == "pull", params
    p_blocks = ours.call({"op": "kv_hashes"})  # after, as in the first test
    assert stock.call({"op": "external_tokens"}) - external == len(x)
    after = stock.call({"op": "kv_hashes"})
    assert_blocks_arrived(p_blocks, before, after, block_ids(params)[: len(x) // BLOCK])
    (local,) = decode(stock, [x], [None])
    assert_same_output(remote, local)


# ---- a kvxfer decode in this process, outside vLLM: bytes, hash and layout checks ----


def _factors(**changes: Any) -> dict[str, Any]:
    """The stock engine's compatibility factors, from the test model's config."""
    c = json.loads((Path(MODEL) / "config.json").read_text())
    f = {
        "vllm_version": "0.32.0",
        "nixl_connector_version": 14,
        "model": str(MODEL),
        "dtype": "torch.float32",
        "num_kv_heads": c["num_key_value_heads"],
        "head_size": c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        "num_hidden_layers": c["num_hidden_layers"],
        "attn_backend_name": "CPU_ATTN",
        "cache_dtype": "auto",
        "is_hma_enabled": True,
        "speculative_config": None,
        "transfer_mode": "pull",
    }
    return {**f, **changes}


class _Decode:
    """A kvxfer pull decode over NIXL with its own cache (`blocks` blocks of the test
    model's geometry, packed K/V) and the given vLLM factors."""

    def __init__(self, factors: dict[str, Any], tokens_per_block: int = BLOCK) -> None:
        c = json.loads((Path(MODEL) / "config.json").read_text())
        heads, layers = c["num_key_value_heads"], c["num_hidden_layers"]
        head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        self.blocks = 16
        self.caches = [
            np.zeros((self.blocks, heads, tokens_per_block, 2 * head), np.float32)
            for _ in range(layers)
        ]
        compat = {"factors": factors, "enforce_hash": True, "region_names": []}
        self.sched = kvxfer.PullScheduler("kvxfer-test-decode", "127.0.0.1", 0)
        self.worker = kvxfer.PullWorker(
            f"kvxfer-test-decode-{time.monotonic_ns()}",
            "nixl",
            dict(
                kind="packed-kv",
                order="HND",
                dtype="float32",
                num_layers=layers,
                kv_heads=heads,
                head_dim=head,
                tokens_per_block=tokens_per_block,
                num_blocks=self.blocks,
                bases=[a.ctypes.data for a in self.caches],
                total_kv_heads=heads,
                total_layers=layers,
            ),
            engine_id="kvxfer-test-decode",
            tp_rank=0,
            tp_size=1,
            options='{"side_channel_port": 0}',
            backend_name="vllm-packed-kv",
            vllm_compat=json.dumps(compat),
        )

    def load(self, params: dict[str, Any], local: list[int]) -> tuple[list[Any], list[str]]:
        """Loads into `local`; (failed loads, received ids) once it ended."""
        self.sched.after_alloc("r", json.dumps(params), local, len(local) * BLOCK)
        assert not self.worker.start_load_kv(self.sched.build_step_meta())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            _, recving, failed = self.worker.get_finished(0.05)
            if recving or failed:
                return failed, recving
        raise AssertionError("the load neither finished nor failed within 30 s")

    def close(self) -> None:
        self.worker.shutdown()


def test_bytes_a_kvxfer_decode_reads_are_the_stock_prefills(mixed: tuple[Engine, Engine]) -> None:
    stock, _ = mixed
    x = prompt(43, 96)
    d = _Decode(_factors())  # first: making a NIXL agent takes a while
    try:

        def handoff(mark: Any) -> tuple[dict[str, Any], tuple[list[Any], list[str]]]:
            (params,) = prefill(stock, [x])
            mark()
            return params, d.load(params, [5, 6, 7])

        params, (failed, recving) = _timed("stock -> in-process decode", handoff)
        p_blocks = stock.call({"op": "kv_hashes"})  # after, as in the first test
        assert not failed and recving == ["r"], failed
        for layer, (name, hashes) in enumerate(sorted(p_blocks.items())):
            for i, block in enumerate(block_ids(params)[:3]):
                got = hashlib.sha256(d.caches[layer][5 + i].tobytes()).hexdigest()
                assert got == hashes[str(block)], f"{name}: block {block}"
    finally:
        d.close()


def test_a_hash_mismatch_is_refused_naming_what_differs(mixed: tuple[Engine, Engine]) -> None:
    stock, _ = mixed
    (params,) = prefill(stock, [prompt(44, 64)])
    d = _Decode(_factors(transfer_mode="push"))
    try:
        failed, _ = d.load(params, [1, 2])
        (req, invalid, reason, _policy) = failed[0]
        assert req == "r" and invalid == [1, 2], failed
        assert 'compatibility hash differs: the peer\'s transfer_mode is "pull"' in reason, reason
    finally:
        d.close()
    d = _Decode(_factors(model="another-model"))
    try:
        failed, _ = d.load(params, [1, 2])
        assert "another-model" in failed[0][2] and "enforce_handshake_compat" in failed[0][2]
    finally:
        d.close()


def test_a_layout_mismatch_is_refused_naming_it(mixed: tuple[Engine, Engine]) -> None:
    stock, ours = mixed
    (params,) = prefill(stock, [prompt(45, 64)])
    prefill(ours, [prompt(49, 64)])  # nobody reads this one either
    d = _Decode(_factors(), tokens_per_block=16)
    try:
        failed, _ = d.load(params, [1, 2])
        assert "block_size: local 16, remote 32" in failed[0][2], failed
    finally:
        d.close()


def test_only_the_unread_requests_leases_expire(mixed: tuple[Engine, Engine]) -> None:
    """Every lease taken above has run out by now. The stock prefill's expired only for
    the two requests nobody read (the hash and layout mismatches): it counted the notes of
    the kvxfer decodes that read the others. kvxfer's expired only for the one nobody read:
    it counted the stock decode's note."""
    stock, ours = mixed
    time.sleep(LEASE + 1)
    _step(stock)
    _step(ours)
    # A read that landed after the stock prefill's lease ran out: it logs one such line each
    # and counts the lease expired.
    late = stock.log_text().count("Potentially invalid KV blocks for unrecognized request")
    calls = "; ".join(HANDOFFS)
    assert _expired(stock, ours) == (2, 1), (
        f"(stock, kvxfer) leases expired; {late} read(s) landed late ({calls})"
    )


def test_a_stock_prefill_restarted_between_requests_costs_at_most_one_request(
    mixed: tuple[Engine, Engine], tmp_path: Path
) -> None:
    """The stock prefill is killed and a new one started under the same engine id and side
    channel port (a new NIXL agent, new addresses). NIXL does not report dead peers, so the
    first request after the restart may fail, with an error, within the transfer timeout;
    the next pulls from the new instance. Runs last: it replaces the module's stock engine."""
    stock, ours = mixed
    x = prompt(46, 64)
    (first,) = decode(ours, [x], prefill(stock, [x]))
    assert first["finish"] == "length"
    port = stock.side_channel_port  # type: ignore[attr-defined]
    stock.close()
    (again,) = start(
        [
            Engine(
                "stock",
                STOCK_CPUS,
                {"kv_lease_duration": LEASE},
                tmp_path,
                model=MODEL,
                connector=STOCK,
                env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)},
            )
        ]
    )
    try:
        outs = []
        for seed in (47, 48):
            y = prompt(seed, 64)
            started = time.monotonic()
            (out,) = decode(ours, [y], prefill(again, [y]), timeout=60)
            outs.append((out, y, time.monotonic() - started))
        first_after, (last, y, _) = outs[0], outs[1]
        assert first_after[0]["finish"] in ("length", "error"), first_after
        assert first_after[2] < TRANSFER_TIMEOUT + 5, "the first request outlived its timeout"
        (local,) = decode(ours, [y], [None])
        assert_same_output(last, local)
    finally:
        again.close()
