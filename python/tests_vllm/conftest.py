"""Real-engine fixtures: a vLLM prefill and a vLLM decode, each in its own process with
KvxferConnector, started once per transport (UCX, NIXL) and shared by the tests."""

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from queue import Empty, Queue
from typing import Any

import pytest

HERE = Path(__file__).parent
MODEL = os.environ.get("KVXFER_TEST_MODEL", str(Path(sys.prefix) / "models" / "tiny-llama"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Engine:
    """A child process running engine.py; `call` sends one command and waits for its reply."""

    def __init__(self, role: str, cpus: str, extra: dict[str, Any], logdir: Path) -> None:
        self.role = role
        ktc = {
            "kv_connector": "KvxferConnector",
            "kv_connector_module_path": "kvxfer.vllm",
            "kv_role": "kv_both",
            "engine_id": f"kvxfer-test-{role}",
            "kv_connector_extra_config": extra,
        }
        env = dict(os.environ)
        env.update(
            {
                "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc(callable) in kv_hashes
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": cpus,
                "TORCHDYNAMO_DISABLE": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        self.log = open(logdir / f"{role}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "engine.py"), role, MODEL, "float32", json.dumps(ktc)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        self.replies: Queue[Any] = Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("KVX "):
                self.replies.put(json.loads(line[4:]))
        self.replies.put(None)  # the process ended

    def wait(self, timeout: float) -> Any:
        try:
            r = self.replies.get(timeout=timeout)
        except Empty:
            raise AssertionError(f"{self.role}: no reply within {timeout} s") from None
        if r is None:
            raise AssertionError(f"{self.role} engine exited: see {self.log.name}")
        return r

    def call(self, cmd: dict[str, Any], timeout: float = 120) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.wait(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call({"op": "quit"}, timeout=5)
            except AssertionError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="session", params=["ucx", "nixl"])
def engines(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Engine, Engine]]:
    if not Path(MODEL, "config.json").exists():
        pytest.skip(f"no test model at {MODEL}: run scripts/vllm-env.sh")
    import kvxfer

    try:
        kvxfer.Agent(f"probe-{os.getpid()}", request.param).shutdown()
    except kvxfer.NotAvailableError as e:
        pytest.skip(f"{request.param}: {e}")
    logdir = tmp_path_factory.mktemp(f"vllm-{request.param}")
    extra = {"transport": request.param}
    p = Engine("prefill", "0", {**extra, "side_channel_port": free_port()}, logdir)
    d = Engine("decode", "1", {**extra, "side_channel_port": free_port()}, logdir)
    try:
        for e in (p, d):
            assert e.wait(timeout=600) == {"ready": e.role}
        yield p, d
    finally:
        p.close()
        d.close()
        print(f"engine logs: {logdir}")
