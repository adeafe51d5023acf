"""Real-engine fixtures: the plain engine's reference outputs, and a prefill server, a decode
server and SGLang's router with the kvxfer backend, started once per transport (UCX, NIXL)
and shared by the tests. The NIXL pair finds its prefill through a real etcd
(``KVXFER_DISCOVERY``, 2 s leases) where an etcd binary is present; the UCX pair through the
prefill's push registry."""

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from harness import (
    LIVE,
    MODEL,
    PROMPT_A,
    PROMPT_B,
    Router,
    Server,
    baseline,
    free_port,
    wait_healthy,
)

import kvxfer
import kvxfer.ucx

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
import live_logs  # noqa: E402
from etcd_server import EtcdServer, etcd_binary  # noqa: E402

# This process's own agents (the probe, the out-of-range decode) use the UCX the servers use:
# the NIXL wheel's, as kvxfer.sglang picks it. Peers on different UCX releases cannot talk.
kvxfer.ucx.select("auto")

STARTUP = float(os.environ.get("KVXFER_SGLANG_STARTUP_TIMEOUT", "900"))
HEARTBEAT = {
    # The decode probes each prefill every 2 s (SGLang's floor) and gives up after 2 misses.
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
}
# Prompts of several lengths for the concurrent requests, A and B first.
PROMPTS = [PROMPT_A, PROMPT_B] + [
    [(i * m + c) % 1000 for i in range(n)]
    for n, m, c in ((37, 3, 1), (150, 11, 2), (256, 17, 9), (511, 5, 4), (700, 19, 6))
]


# The engine id and cluster the NIXL pair's prefill registers under.
ENGINE_ID = "sgl-prefill"
CLUSTER = "sgl"


@dataclass
class Pair:
    """A prefill, a decode and the router over them; `etcd` when they use discovery."""

    transport: str
    logdir: Path
    prefill: Server
    decode: Server
    router: Router
    etcd: EtcdServer | None = None
    env: dict[str, str] = field(default_factory=dict)

    def start_prefill(self, name: str) -> Server:
        """A new prefill on the same bootstrap port (after the first one died)."""
        self.prefill = Server(
            "prefill",
            "0",
            self.logdir,
            transport=self.transport,
            bootstrap_port=self.prefill.bootstrap_port,
            name=name,
            env=self.env,
        )
        return self.prefill

    def close(self) -> None:
        for p in (self.router, self.decode, self.prefill):
            p.close()
        if self.etcd is not None:
            self.etcd.close()


# A failing test's report quotes the logs of the processes still running.
pytest_runtest_makereport = live_logs.report_hook(LIVE, lambda p: f"server log excerpt: {p.name}")


def _usable_or_skip(transport: str) -> None:
    if not Path(MODEL, "config.json").exists():
        pytest.skip(f"no test model at {MODEL}: run scripts/sglang-env.sh")
    try:
        kvxfer.Agent(f"probe-{os.getpid()}", transport).shutdown()
    except kvxfer.NotAvailableError as e:
        pytest.skip(f"{transport}: {e}")


@pytest.fixture(scope="session")
def logdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("sglang")
    print(f"server logs: {d}")
    return d


@pytest.fixture(scope="session")
def reference(logdir: Path) -> dict[tuple[int, ...], dict]:
    """Each prompt's tokens and logprobs from a plain SGLang engine."""
    if not Path(MODEL, "config.json").exists():
        pytest.skip(f"no test model at {MODEL}: run scripts/sglang-env.sh")
    return {tuple(p): r for p, r in zip(PROMPTS, baseline(PROMPTS, logdir), strict=True)}


@pytest.fixture(scope="session", params=["ucx", "nixl"])
def pair(request: pytest.FixtureRequest, logdir: Path, reference: dict) -> Iterator[Pair]:
    transport = request.param
    _usable_or_skip(transport)
    boot = free_port()
    binary = etcd_binary() if transport == "nixl" else None
    etcd = EtcdServer(binary) if binary else None
    env = {}
    if etcd is not None:
        env = {
            "KVXFER_DISCOVERY": etcd.url,
            "KVXFER_CLUSTER": CLUSTER,
            "KVXFER_ENGINE_ID": ENGINE_ID,
            "KVXFER_LEASE_TTL": "2",
        }
    prefill = Server("prefill", "0", logdir, transport=transport, bootstrap_port=boot, env=env)
    decode = Server(
        "decode",
        "1",
        logdir,
        transport=transport,
        bootstrap_port=boot,
        # The UCX pair's decode checks content digests on every room (#38), the NIXL pair's
        # does not (the default).
        env={**HEARTBEAT, **env, **({"KVXFER_DIGEST": "1"} if transport == "ucx" else {})},
        args=("--enable-metrics",),  # its deferred page releases, counted by outcome
    )
    servers = [prefill, decode]
    try:
        wait_healthy(servers, STARTUP)
        router = Router(prefill, decode, logdir, f"router-{transport}")
        servers.append(router)
        wait_healthy([router], 120)
    except BaseException:
        for s in servers:
            s.close()
        if etcd is not None:
            etcd.close()
        raise
    p = Pair(transport, logdir, prefill, decode, router, etcd, env)
    yield p
    p.close()
