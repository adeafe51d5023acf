"""One same-host READ between two processes over kvxfer's ``ucx`` transport, with the UCX
library chosen as KvxferConnector chooses it (``kvxfer.ucx.select``). Prints one JSON line:
the library, its version and whether the bytes arrived. UCX's own output (``UCX_PROTO_INFO``
and the like) goes to the same stdout.

Usage: same_host_read.py [UCX_LIBRARY_SETTING]   (default ``auto``)
"""

import json
import multiprocessing as mp
import sys
from multiprocessing.queues import Queue
from typing import Any

import numpy as np

SIZE = 8 << 20


def source(meta: "Queue[Any]", done: "Queue[Any]") -> None:
    import kvxfer

    agent = kvxfer.Agent("source", "ucx")
    buf = np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8)
    agent.register(buf)
    meta.put((agent.metadata(), buf.ctypes.data, buf.tobytes()))
    done.get(timeout=60)
    agent.shutdown()


def main() -> int:
    import kvxfer
    import kvxfer.ucx

    library = kvxfer.ucx.select(sys.argv[1] if len(sys.argv) > 1 else "auto")
    version = kvxfer.ucx_version()
    ctx = mp.get_context("spawn")  # the child inherits KVXFER_UCX_LIBRARY, not a loaded UCX
    meta, done = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=source, args=(meta, done))
    child.start()
    try:
        metadata, remote, expected = meta.get(timeout=60)
        agent = kvxfer.Agent("reader", "ucx")
        dst = np.zeros(SIZE, dtype=np.uint8)
        agent.register(dst)
        peer = agent.load_peer(metadata)
        xfer = agent.read(peer, [(dst.ctypes.data, SIZE)], [(remote, SIZE)])
        agent.wait(xfer)
        agent.release(xfer)
        ok = dst.tobytes() == expected
        agent.shutdown()
    finally:
        done.put(1)
        child.join(timeout=60)
    print(json.dumps({"library": library, "version": version, "ok": ok}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
