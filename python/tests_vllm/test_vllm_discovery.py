"""KvxferConnector with discovery inside a real vLLM: a prefill and a decode engine register
their ranks in a real etcd (``kv_connector_extra_config["discovery"]``) under 2 s leases, a
request flows as without it, and a SIGKILLed prefill's keys go within TTL + 1 s, after which
the decode reports the engine lost on its next step."""

import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import _usable_or_skip
from flows import assert_same_output, decode, kvxfer_metrics, prefill, prompt
from harness import MODEL, Engine, free_port, start

import kvxfer

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from etcd_server import EtcdServer, etcd_binary  # noqa: E402

CLUSTER = "vllm"
TTL = 2


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[EtcdServer, Engine, Engine, int]]:
    _usable_or_skip("ucx")
    binary = etcd_binary()
    if binary is None:
        pytest.skip("no etcd binary (set KVXFER_ETCD_BIN or install etcd-server)")
    etcd = EtcdServer(binary)
    logdir = tmp_path_factory.mktemp("vllm-discovery")
    extra = {"transport": "ucx", "discovery": etcd.url, "cluster": CLUSTER, "lease_ttl": TTL}
    pport = free_port()
    try:
        p, d = start(
            [
                Engine("prefill", "0", {**extra, "side_channel_port": pport}, logdir, model=MODEL),
                Engine(
                    "decode", "1", {**extra, "side_channel_port": free_port()}, logdir, model=MODEL
                ),
            ]
        )
    except BaseException:
        etcd.close()
        raise
    try:
        yield etcd, p, d, pport
    finally:
        p.close()
        d.close()
        etcd.close()
        print(f"engine logs: {logdir}")


def _engine(
    watch: kvxfer.FleetWatch, engine_id: str
) -> list[tuple[tuple[int, int, int], str, int]]:
    deadline = time.monotonic() + 30
    while (ranks := watch.engine(engine_id)) is None:
        assert time.monotonic() < deadline, f"{engine_id} never registered"
        time.sleep(0.05)
    return ranks


def test_each_engine_registers_its_rank_and_a_request_flows(
    fleet: tuple[EtcdServer, Engine, Engine, int],
) -> None:
    etcd, p, d, pport = fleet
    watch = kvxfer.FleetWatch(etcd.url, CLUSTER, "prefill")
    try:
        [(rank, endpoint, instance)] = _engine(watch, "kvxfer-test-prefill")
        assert rank == (0, 0, 0)
        assert endpoint == f"127.0.0.1:{pport}"
        assert instance != 0
        # kv_both: the decode engine also serves reads, so it registers as a prefill too.
        assert _engine(watch, "kvxfer-test-decode")[0][2] != instance
    finally:
        watch.close()
    x = prompt(41, 100)
    (remote,) = decode(d, [x], prefill(p, [x]))
    (local,) = decode(d, [x], [None])
    assert_same_output(remote, local)


def test_a_killed_prefill_expires_and_the_decode_reports_it_lost(
    fleet: tuple[EtcdServer, Engine, Engine, int],
) -> None:
    etcd, p, d, _ = fleet
    prefix = f"/kvxfer/v1/{CLUSTER}/engines/prefill/kvxfer-test-prefill/"
    assert etcd.keys(prefix) == 1
    lost_before = kvxfer_metrics(d).get("vllm:kvxfer_lost_connections", 0)
    p.signal(signal.SIGKILL)
    killed = time.monotonic()
    while etcd.keys(prefix) != 0:
        assert time.monotonic() - killed < 30, "the killed prefill's keys never went"
        time.sleep(0.02)
    gone_after = time.monotonic() - killed
    # TTL 2 s and etcd's 0.5 s expiry check; the process group's death is immediate.
    assert gone_after < TTL + 1, f"keys gone after {gone_after:.2f} s"
    print(f"keys of the killed prefill gone after {gone_after:.2f} s")
    # The decode acts on the loss at its next step.
    (out,) = decode(d, [prompt(42, 40)], [None])
    assert out["finish"] == "length"
    deadline = time.monotonic() + 30
    want = "kvxfer: prefill engine kvxfer-test-prefill lost: rank 0.0.0 deregistered"
    while want not in d.log_text():
        assert time.monotonic() < deadline, "the decode never reported the prefill lost"
        (out,) = decode(d, [prompt(43, 40)], [None])
    # Its connection to the dead prefill was dropped, not kept for the next request.
    while kvxfer_metrics(d).get("vllm:kvxfer_lost_connections", 0) == lost_before:
        assert time.monotonic() < deadline, "the connection to the dead prefill was kept"
        decode(d, [prompt(44, 40)], [None])
    assert kvxfer_metrics(d)["vllm:kvxfer_lost_connections"] == lost_before + 1
