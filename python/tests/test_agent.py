"""The transport agent from Python: transfers that move the right bytes, and bad input that
raises a typed exception instead of crashing the interpreter."""

import gc
import itertools
import threading
import time

import numpy as np
import pytest
from conftest import pattern

import kvxfer

_ids = itertools.count()


def pair(transport: str) -> tuple[kvxfer.Agent, kvxfer.Agent]:
    n = next(_ids)
    return kvxfer.Agent(f"a{n}", transport), kvxfer.Agent(f"b{n}", transport)


def addr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def test_read_and_write_move_the_bytes_and_notify(transport: str) -> None:
    a, b = pair(transport)
    src, dst = pattern(1 << 20, 1), np.zeros(1 << 20, dtype=np.uint8)
    a.register(dst)
    b.register(src)
    peer_b = a.load_peer(b.metadata())
    peer_a = b.load_peer(a.metadata())
    # READ two pieces of b's buffer into a's, with a notification to b.
    x = a.read(
        peer_b,
        [(addr(dst), 4096), (addr(dst) + 8192, 100)],
        [(addr(src) + 4096, 4096), (addr(src), 100)],
        notification=b"req-1:1",
    )
    a.wait(x, timeout=30)
    a.release(x)
    assert np.array_equal(dst[:4096], src[4096:8192])
    assert np.array_equal(dst[8192:8292], src[:100])
    assert not dst[4096:8192].any() and not dst[8292:].any()
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + 30
    while not got and time.monotonic() < deadline:
        got = b.notifications()
        time.sleep(0.001)
    assert got == [(a.name, b"req-1:1")]
    # WRITE back from b: the first 64 KiB of src over dst.
    x = b.write(peer_a, [(addr(src), 65536)], [(addr(dst), 65536)])
    b.wait(x)
    b.release(x)
    assert np.array_equal(dst[:65536], src[:65536])
    a.shutdown()
    b.shutdown()


def test_indexed_transfers_between_prepared_lists(transport: str) -> None:
    a, b = pair(transport)
    src, dst = pattern(64 * 1024, 2), np.zeros(64 * 1024, dtype=np.uint8)
    a.register(dst)
    b.register(src)
    peer = a.load_peer(b.metadata())
    blocks = [(addr(dst) + i * 1024, 1024) for i in range(64)]
    remote = [(addr(src) + i * 1024, 1024) for i in range(64)]
    local_list = a.prepare_local(blocks)
    remote_list = a.prepare_remote(peer, remote)
    x = a.read_indexed(local_list, [0, 5, 9], remote_list, [63, 1, 2])
    a.wait(x)
    a.release(x)
    for d, s in [(0, 63), (5, 1), (9, 2)]:
        assert np.array_equal(dst[d * 1024 : (d + 1) * 1024], src[s * 1024 : (s + 1) * 1024])
    with pytest.raises(kvxfer.InvalidArgumentError):
        a.read_indexed(local_list, [64], remote_list, [0])
    with pytest.raises(kvxfer.InvalidArgumentError):
        a.read_indexed(local_list, [0, 1], remote_list, [0])
    a.release_list(local_list)
    with pytest.raises(kvxfer.InvalidArgumentError):
        a.read_indexed(local_list, [0], remote_list, [0])
    a.shutdown()
    b.shutdown()


def test_ranges_outside_registered_memory_are_refused(transport: str) -> None:
    a, b = pair(transport)
    src, dst = pattern(8192, 3), np.zeros(8192, dtype=np.uint8)
    a.register(dst)
    b.register(src)
    peer = a.load_peer(b.metadata())
    other = np.zeros(8192, dtype=np.uint8)  # never registered
    for local, remote in [
        ((addr(dst), 8193), (addr(src), 8193)),  # past the end on both sides
        ((addr(other), 16), (addr(src), 16)),  # local memory not registered
        ((addr(dst), 16), (addr(other), 16)),  # remote memory not advertised
        ((addr(dst) - 1, 16), (addr(src), 16)),  # before the start
    ]:
        with pytest.raises(kvxfer.OutOfBoundsError):
            a.read(peer, [local], [remote])
    with pytest.raises(kvxfer.InvalidArgumentError):
        a.read(peer, [(addr(dst), 16)], [(addr(src), 32)])  # lengths differ
    assert not dst.any()
    a.shutdown()
    b.shutdown()


def test_bad_memory_is_an_exception() -> None:
    a = kvxfer.Agent(f"mem{next(_ids)}")
    buf = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(kvxfer.InvalidMemoryError):
        a.register(8, 4096)  # unmapped page zero
    with pytest.raises(kvxfer.InvalidMemoryError):
        a.register(2**64 - 4096, 8192)  # wraps
    with pytest.raises(kvxfer.InvalidMemoryError):
        a.register(addr(buf), 0)
    with pytest.raises(kvxfer.InvalidArgumentError):
        a.register(buf, 8192)  # longer than the array
    with pytest.raises(kvxfer.InvalidArgumentError):
        a.register(addr(buf))  # raw address without a length
    with pytest.raises(kvxfer.InvalidArgumentError):
        a.register("not memory")
    with pytest.raises(kvxfer.InvalidArgumentError):
        a.register(buf, memory="tpu")
    with pytest.raises(kvxfer.InvalidArgumentError):
        a.register(-1, 16)  # not an address
    a.shutdown()


def test_registered_objects_stay_alive_and_deregistered_memory_is_refused() -> None:
    a, b = pair("loopback")
    n = 1 << 20  # above malloc's mmap threshold: a freed array would be unmapped

    def register_temporary() -> tuple[int, int]:
        tmp = pattern(n, 4)
        return b.register(tmp), addr(tmp)

    handle, src = register_temporary()  # only the agent holds that array now
    gc.collect()
    dst = np.zeros(n, dtype=np.uint8)
    a.register(dst)
    peer = a.load_peer(b.metadata())
    x = a.read(peer, [(addr(dst), n)], [(src, n)])
    a.wait(x)
    a.release(x)
    assert np.array_equal(dst, pattern(n, 4))
    b.deregister(handle)
    with pytest.raises(kvxfer.InvalidArgumentError):
        b.deregister(handle)
    peer = a.load_peer(b.metadata())
    with pytest.raises(kvxfer.OutOfBoundsError):
        a.read(peer, [(addr(dst), 16)], [(src, 16)])
    a.shutdown()
    b.shutdown()


def test_garbage_metadata_and_unknown_ids() -> None:
    a = kvxfer.Agent(f"g{next(_ids)}")
    for junk in [b"", b"\x00" * 7, b"KVX", bytes(range(256)) * 64]:
        with pytest.raises(kvxfer.InvalidMetadataError):
            a.load_peer(junk)
    buf = np.zeros(64, dtype=np.uint8)
    a.register(buf)
    with pytest.raises(kvxfer.UnknownPeerError):
        a.read(12345, [(addr(buf), 1)], [(0, 1)])
    with pytest.raises(kvxfer.UnknownPeerError):
        a.notify(12345, b"x")
    with pytest.raises(kvxfer.InvalidArgumentError):
        a.status(999)
    with pytest.raises(kvxfer.InvalidArgumentError):
        a.release(999)
    with pytest.raises(kvxfer.InvalidArgumentError):
        a.wait(999, timeout=float("nan"))
    with pytest.raises(kvxfer.NotSupportedError):
        kvxfer.Agent("x", "carrier-pigeon")
    with pytest.raises(kvxfer.InvalidArgumentError):
        kvxfer.Agent("")
    a.shutdown()


def test_calls_after_shutdown_raise() -> None:
    a = kvxfer.Agent(f"s{next(_ids)}")
    a.register(np.zeros(4096, dtype=np.uint8))
    a.shutdown()
    a.shutdown()  # twice is fine
    for call in [
        lambda: a.metadata(),
        lambda: a.register(np.zeros(16, dtype=np.uint8)),
        lambda: a.load_peer(b"x"),
        lambda: a.status(1),
        lambda: a.notifications(),
        lambda: a.capabilities(),
    ]:
        with pytest.raises(kvxfer.ShutDownError):
            call()


def test_wait_releases_the_gil() -> None:
    a, b = pair("loopback")
    src, dst = pattern(64 << 20, 5), np.zeros(64 << 20, dtype=np.uint8)
    a.register(dst)
    b.register(src)
    peer = a.load_peer(b.metadata())
    ticks = 0
    stop = threading.Event()

    def count() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    t = threading.Thread(target=count)
    t.start()
    before = ticks
    for _ in range(4):
        x = a.read(peer, [(addr(dst), dst.nbytes)], [(addr(src), src.nbytes)])
        a.wait(x)
        a.release(x)
    stop.set()
    t.join()
    assert ticks > before, "the counting thread never ran while transfers were awaited"
    assert np.array_equal(dst, src)
    a.shutdown()
    b.shutdown()
