"""SharedHostMemory: host memory in kvxfer shared memory, usable as a numpy (or torch) array
and registered like any other; same-host ucx agents move it by mapping each other's."""

import gc
import itertools

import numpy as np
import pytest
from conftest import pattern

import kvxfer

_ids = itertools.count()


def test_it_is_a_writable_zeroed_byte_array_that_keeps_its_memory_alive() -> None:
    mem = kvxfer.SharedHostMemory(3 << 20)
    assert mem.nbytes == len(mem) == 3 << 20
    view = np.asarray(mem)
    assert view.dtype == np.uint8 and view.shape == (3 << 20,)
    assert int(view.__array_interface__["data"][0]) == mem.data_ptr()
    assert not view.any()
    view[:5] = [1, 2, 3, 4, 5]
    assert np.asarray(mem)[:5].tolist() == [1, 2, 3, 4, 5]
    del mem
    gc.collect()
    # The array's base is the memory: still mapped.
    assert view[:5].tolist() == [1, 2, 3, 4, 5]
    assert "SharedHostMemory(nbytes=5" in repr(kvxfer.SharedHostMemory(5))


def test_sizes_it_cannot_have_raise() -> None:
    with pytest.raises(kvxfer.InvalidArgumentError):
        kvxfer.SharedHostMemory(0)
    with pytest.raises(kvxfer.InvalidArgumentError, match="available"):
        kvxfer.SharedHostMemory(1 << 62)


def test_transfers_between_shared_caches_move_the_bytes(transport: str) -> None:
    n = next(_ids)
    a, b = kvxfer.Agent(f"sa{n}", transport), kvxfer.Agent(f"sb{n}", transport)
    src_mem, dst_mem = kvxfer.SharedHostMemory(4 << 20), kvxfer.SharedHostMemory(4 << 20)
    src, dst = np.asarray(src_mem), np.asarray(dst_mem)
    src[:] = pattern(4 << 20, 7)
    b.register(src_mem)
    a.register(dst_mem)
    peer_b = a.load_peer(b.metadata())
    s, d = src_mem.data_ptr(), dst_mem.data_ptr()
    # 256 blocks of 16 KiB, in reverse order.
    blocks = 256
    local = [(d + i * 16384, 16384) for i in range(blocks)]
    remote = [(s + (blocks - 1 - i) * 16384, 16384) for i in range(blocks)]
    x = a.read(peer_b, local, remote)
    a.wait(x, timeout=30)
    a.release(x)
    want = src.reshape(blocks, 16384)[::-1].reshape(-1)
    assert np.array_equal(dst, want)
    x = a.write(peer_b, [(d, 4096)], [(s + 8192, 4096)])
    a.wait(x, timeout=30)
    a.release(x)
    assert np.array_equal(src[8192:12288], dst[:4096])
    a.shutdown()
    b.shutdown()
