"""kvxfer.Registration and kvxfer.FleetWatch against a real etcd; the pull worker's instance,
layout digest and engine_lost."""

import time
from collections.abc import Iterator

import pytest
from etcd_server import EtcdServer, etcd_binary

import kvxfer


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdServer]:
    binary = etcd_binary()
    if binary is None:
        pytest.skip("no etcd binary (set KVXFER_ETCD_BIN or install etcd-server)")
    server = EtcdServer(binary)
    try:
        yield server
    finally:
        server.close()


def _changes(watch: kvxfer.FleetWatch, n: int) -> list[tuple[str, str, str]]:
    seen: list[tuple[str, str, str]] = []
    deadline = time.monotonic() + 30
    while len(seen) < n:
        seen += watch.changes()
        assert time.monotonic() < deadline, f"only {seen}"
        time.sleep(0.01)
    return seen


def _register(etcd: EtcdServer, engine: str, tp: int, instance: int) -> kvxfer.Registration:
    return kvxfer.Registration(
        etcd.url,
        "py",
        "prefill",
        engine,
        (0, 0, tp),
        (1, 1, 2),
        f"127.0.0.1:{5600 + tp}",
        instance,
        "sha256:0123456789abcdef",
        ttl=10,
    )


def test_a_two_rank_engine_is_found_and_a_close_loses_it(etcd: EtcdServer) -> None:
    watch = kvxfer.FleetWatch(etcd.url, "py", "prefill")
    r0 = _register(etcd, "p", 0, 11)
    assert watch.engine("p") is None, "one rank of two is not an engine"
    r1 = _register(etcd, "p", 1, 12)
    assert _changes(watch, 1) == [("ready", "p", "")]
    assert watch.engine("p") == [
        ((0, 0, 0), "127.0.0.1:5600", 11),
        ((0, 0, 1), "127.0.0.1:5601", 12),
    ]
    st = r0.status()
    assert st["registered"] and st["registrations"] == 1 and st["lease"] != 0
    assert watch.status()["connected"]
    r1.close()
    r1.close()
    [(kind, engine, reason)] = _changes(watch, 1)
    assert (kind, engine) == ("lost", "p")
    assert "rank 0.0.1 deregistered" in reason
    with pytest.raises(kvxfer.ShutDownError):
        r1.status()
    r0.close()
    watch.close()
    assert etcd.keys("/kvxfer/v1/py/") == 0


def test_bad_arguments_and_an_unreachable_etcd_are_clear_errors(etcd: EtcdServer) -> None:
    ok = (etcd.url, "py", "prefill", "e", (0, 0, 0), (1, 1, 1), "h:1", 1, "L")
    for i, bad in [(0, "http2://x"), (2, "router"), (3, "a/b"), (4, (0, 0, 1)), (6, "")]:
        args = list(ok)
        args[i] = bad
        with pytest.raises(kvxfer.InvalidArgumentError):
            kvxfer.Registration(*args)
    with pytest.raises(kvxfer.InvalidArgumentError):
        kvxfer.Registration(*ok, ttl=0.5)
    with pytest.raises(kvxfer.InvalidArgumentError):
        kvxfer.FleetWatch(etcd.url, "bad cluster")
    dead = "etcd://127.0.0.1:1"
    with pytest.raises(kvxfer.DiscoveryError, match="etcd unreachable at 127.0.0.1:1"):
        kvxfer.Registration(dead, *ok[1:])
    with pytest.raises(kvxfer.DiscoveryError, match="etcd unreachable"):
        kvxfer.FleetWatch(dead, "py")


def test_a_push_room_goes_through_etcd_and_bad_arguments_are_refused(etcd: EtcdServer) -> None:
    """A push prefill rank registered in etcd and a decode whose rooms name a bootstrap
    address where nothing listens: only etcd can tell the decode the rank, and the room
    moves every page."""
    from test_push import Rank, ranks, until

    nowhere = ("127.0.0.1", 1)
    dst = Rank(seed=None)
    with pytest.raises(kvxfer.InvalidArgumentError):
        kvxfer.PushDecode(
            "disc-bad", "loopback", dst.layout(), tp_rank=0, tp_size=1, discovery=(etcd.url, "a/b")
        )
    with pytest.raises(kvxfer.DiscoveryError, match="etcd unreachable"):
        kvxfer.PushDecode(
            "disc-dead",
            "loopback",
            dst.layout(),
            tp_rank=0,
            tp_size=1,
            discovery=("etcd://127.0.0.1:1", "py"),
        )
    registry, prefill, decode, src, dst = ranks("loopback", discovery=(etcd.url, "py"))
    with pytest.raises(kvxfer.InvalidArgumentError, match="ttl"):
        prefill.register(etcd.url, "py", "pe", nowhere, 7, ttl=1.0)
    with pytest.raises(kvxfer.InvalidArgumentError):
        prefill.register(etcd.url, "py", "p e", nowhere, 7)
    reg = prefill.register(etcd.url, "py", "pe", nowhere, 7, ttl=2.0)
    try:
        decode.add_room(9, nowhere, [4, 5])
        until(lambda: prefill.destinations_ready(9), prefill, decode)
        prefill.add_room(9, 2)
        prefill.send(9, [1, 0])
        until(lambda: decode.status(9) == 4, prefill, decode)
        for region in range(len(src.kv)):
            assert dst.page(region, 4) == src.page(region, 1)
            assert dst.page(region, 5) == src.page(region, 0)
    finally:
        decode.shutdown()
        reg.close()
        prefill.shutdown()
        registry.shutdown()


def test_the_worker_names_its_instance_and_layout_and_takes_losses() -> None:
    from test_pull import cache, worker

    arrays = [cache("split-kv", None) for _ in range(3)]
    (a, _), (b, _) = (
        worker("disc", "loopback", "split-kv", arrays[0]),
        worker("disc", "loopback", "split-kv", arrays[1]),
    )
    (c, _) = worker("disc", "loopback", "split-kv", arrays[2], {"order": "NHD"})
    try:
        assert a.instance() != b.instance()
        assert a.layout_digest() == b.layout_digest() != c.layout_digest()
        assert a.layout_digest().startswith("sha256:")
        a.engine_lost("never-connected", "gone")  # nothing to fail
        assert a.get_finished() == ([], [], [])
    finally:
        for w in (a, b, c):
            w.shutdown()
