"""A real single-node etcd for tests: 127.0.0.1, free ports, data in tmpfs, killed and removed
at the end. The binary is ``$KVXFER_ETCD_BIN`` (the test command sets it: then a missing etcd
fails) or ``etcd`` on the PATH (else the tests skip)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path


def etcd_binary() -> str | None:
    """The etcd binary, or None (skip). Raises when KVXFER_ETCD_BIN names a missing file."""
    named = os.environ.get("KVXFER_ETCD_BIN")
    if named:
        if not Path(named).is_file():
            raise FileNotFoundError(f"KVXFER_ETCD_BIN={named} is not a file")
        return named
    return shutil.which("etcd")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class EtcdServer:
    """etcd in a child process; `url` is ``etcd://127.0.0.1:PORT``."""

    def __init__(self, binary: str) -> None:
        base = "/dev/shm" if Path("/dev/shm").is_dir() else None
        self.dir = Path(tempfile.mkdtemp(prefix="kvxfer-etcd-", dir=base))
        self.client_port = _free_port()
        peer = f"http://127.0.0.1:{_free_port()}"
        client = f"http://127.0.0.1:{self.client_port}"
        self.url = f"etcd://127.0.0.1:{self.client_port}"
        self.log = open(self.dir / "etcd.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [binary, "--name", "t", "--data-dir", str(self.dir / "data")]
            + ["--listen-client-urls", client, "--advertise-client-urls", client]
            + ["--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer]
            + [f"--initial-cluster=t={peer}", "--logger", "zap", "--log-level", "warn"],
            stdout=self.log,
            stderr=self.log,
        )
        deadline = time.monotonic() + 30
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"etcd did not start: {(self.dir / 'etcd.log').read_text()}")
            time.sleep(0.05)

    def _answers(self) -> bool:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.client_port}/v3/kv/range", data=b'{"key":"AA=="}'
        )
        try:
            with urllib.request.urlopen(req, timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def keys(self, prefix: str) -> int:
        """How many keys start with `prefix`."""
        import base64
        import json

        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        body = json.dumps(
            {
                "key": base64.b64encode(prefix.encode()).decode(),
                "range_end": base64.b64encode(end.encode()).decode(),
                "count_only": True,
            }
        ).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.client_port}/v3/kv/range", data=body)
        with urllib.request.urlopen(req, timeout=5) as r:
            return int(json.load(r).get("count", 0))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
