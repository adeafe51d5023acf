"""A real vLLM engine in a child process (engine.py), for the real-engine tests and the
benchmark: started with a KV connector, driven one JSON command at a time."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from queue import Empty, Queue
from typing import Any

HERE = Path(__file__).parent
MODELS = Path(sys.prefix) / "models"
MODEL = Path(os.environ.get("KVXFER_TEST_MODEL", str(MODELS / "tiny-llama")))
# Full and 64-token sliding-window layers alternating (make_model.py's `hybrid` preset).
HYBRID_MODEL = MODELS / "tiny-hybrid"
# A DeepSeek-V2 with multi-head latent attention (make_model.py's `mla` preset).
MLA_MODEL = MODELS / "tiny-mla"
# A Mamba2: per-request state instead of a KV cache (make_model.py's `mamba2` preset).
MAMBA_MODEL = MODELS / "tiny-mamba2"
# Mamba2 layers beside attention layers (make_model.py's `nemotron-h` preset).
NEMOTRON_MODEL = MODELS / "tiny-nemotron-h"
KVXFER = ("KvxferConnector", "kvxfer.vllm")
STOCK = ("NixlConnector", "vllm.distributed.kv_transfer.kv_connector.v1.nixl")
_handed_out: set[int] = set()
# Engines started and not yet closed: a failing test's report quotes their logs.
LIVE: list["Engine"] = []


def pinned(cpus: str) -> list[str]:
    """`taskset` arguments that keep a whole engine (front end, EngineCore, workers and
    their threads) on the cores `cpus` names (vLLM's OMP binding syntax: "0", "0|1"), as
    on a host of its own. A stock vLLM engine spins (NIXL's progress thread polls without
    sleeping, and EngineCore steps back-to-back while it holds blocks for a decode): left
    to float on a 2-core machine it starves the engine it hands off to until its lease runs
    out. Nothing is pinned where those cores are not all this process's to give."""
    cores: set[int] = set()
    for item in cpus.replace("|", ",").split(","):
        first, _, last = item.strip().partition("-")
        if first:
            cores.update(range(int(first), int(last or first) + 1))
    if not cores or not cores <= os.sched_getaffinity(0):
        return []
    return ["taskset", "-c", ",".join(str(c) for c in sorted(cores))]


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768+), so that the sockets vLLM opens on
    ephemeral ports meanwhile cannot take it before the engine binds it."""
    rng = random.SystemRandom()
    while True:
        port = rng.randrange(20000, 32000)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port


class Engine:
    """A child process running engine.py; `call` sends one command and waits for its reply.

    The child leads its own process group, so `signal` reaches every process vLLM started
    (an EngineCore process where one runs, TP workers) too.
    """

    def __init__(
        self,
        name: str,
        cpus: str,
        extra: dict[str, Any],
        logdir: Path,
        *,
        model: str | Path = MODELS / "tiny-llama",
        opts: dict[str, Any] | None = None,
        connector: tuple[str, str] = KVXFER,
        transfer_config: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.role = name
        ktc = {
            "kv_connector": connector[0],
            "kv_connector_module_path": connector[1],
            "kv_role": "kv_both",
            "engine_id": f"kvxfer-test-{name}",
            "kv_connector_extra_config": extra,
            **(transfer_config or {}),
        }
        # An operator's vLLM environment: kvxfer finds the NIXL wheel vLLM installed itself
        # (kvxfer.nixl), with no loader path or plugin directory pointing at one.
        full_env = {
            k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "NIXL_PLUGIN_DIR")
        }
        full_env.update(
            {
                "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc(callable)
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": cpus,
                "TORCHDYNAMO_DISABLE": "1",
                "PYTHONUNBUFFERED": "1",
                # EngineCore in the engine's own process: on its one pinned core a start
                # then imports torch and vLLM once, not twice (12 s instead of 26 s). The
                # connector's two halves still share one process, as in EngineCore; the
                # benchmark and `vllm serve` keep vLLM's separate EngineCore process.
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "PYTHONPATH": os.pathsep.join(
                    [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
                ),
                **(env or {}),
            }
        )
        self.log_path = logdir / f"{name}.log"
        # vLLM logs to stdout, Python's warnings to stderr: both go to the log, appended
        # (O_APPEND) so that the two writers never overwrite each other.
        self.log_path.write_bytes(b"")
        self.log = open(self.log_path, "a")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                *pinned(cpus),
                sys.executable,
                str(HERE / "engine.py"),
                name,
                str(model),
                json.dumps(opts or {}),
                json.dumps(ktc),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=full_env,
            start_new_session=True,
        )
        self.replies: Queue[Any] = Queue()
        threading.Thread(target=self._read, daemon=True).start()
        LIVE.append(self)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log_path, "a") as log:
            for line in self.proc.stdout:
                if line.startswith("KVX "):
                    self.replies.put(json.loads(line[4:]))
                else:
                    log.write(line)
                    log.flush()
        self.replies.put(None)  # the process ended

    def wait(self, timeout: float) -> Any:
        try:
            r = self.replies.get(timeout=timeout)
        except Empty:
            raise AssertionError(f"{self.role}: no reply within {timeout} s") from None
        if r is None:
            raise AssertionError(f"{self.role} engine exited: see {self.log_path}")
        return r

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def call(self, cmd: dict[str, Any], timeout: float = 120) -> Any:
        self.send(cmd)
        return self.wait(timeout)

    def signal(self, sig: signal.Signals) -> None:
        """Sends `sig` to the engine and every process it started."""
        os.killpg(self.proc.pid, sig)

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """Kills the engine and every process it started, without waiting. vLLM's own
        shutdown on a CPU engine waits 5 s for a worker that does not exit and then kills it
        anyway (stock engines as well): ~100 s of the suite, and nothing a test checks
        happens in it."""
        try:
            self.signal(signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        """Kills the engine (see `kill`) and waits until it is gone."""
        self.kill()
        self.proc.wait()
        self.log.close()
        if self in LIVE:
            LIVE.remove(self)


def start(engines: list[Engine], timeout: float = 600) -> list[Engine]:
    """Waits until every engine is ready (they start in parallel); closes all on failure."""
    try:
        for e in engines:
            assert e.wait(timeout=timeout) == {"ready": e.role}
    except BaseException:
        close_all(engines)
        raise
    return engines


def close_all(engines: list[Engine]) -> None:
    """Closes `engines`: all killed first, then each waited for. One at a time, a peer
    left running could take the core a dying engine is pinned to (a decode's TP worker
    polling its UCX worker after its prefill died kept one from exiting for 6 minutes)."""
    for e in engines:
        e.kill()
    for e in engines:
        e.close()
