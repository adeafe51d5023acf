"""Real SGLang servers for the tests and the benchmark: a prefill and a decode
(``sglang.launch_server``) and SGLang's router, each in its own process group, with the settings
SGLang needs on a CPU-only machine, and the offline baseline (``baseline.py``)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import requests

HERE = Path(__file__).parent
MODEL = Path(os.environ.get("KVXFER_SGLANG_MODEL", str(Path(sys.prefix) / "models" / "tiny-llama")))
_handed_out: set[int] = set()
# Processes started and not yet closed: a failing test's report quotes their logs.
LIVE: list[Process] = []

# The NIXL runtime the test command exports (for kvxfer's own agents): servers that pair with
# SGLang's own nixl backend leave it out and use the engine's (the nixl wheel SGLang imports).
NIXL_ENV = ("NIXL_PLUGIN_DIR", "LD_LIBRARY_PATH")
# On a servers' path: SGLang's nixl backend registers its host memory as such (see there).
NIXL_DRAM = HERE / "nixl_dram"

PROMPT_A = [(i * 7 + 3) % 1000 for i in range(100)]
PROMPT_B = [(i * 13 + 5) % 1000 for i in range(100)]


def free_port() -> int:
    """A free port below Linux's ephemeral range, never handed out twice in a run, so that
    servers started side by side never collide and no outgoing socket takes it first."""
    rng = random.SystemRandom()
    while True:
        port = rng.randrange(33000 - 12000, 33000 - 1000)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port


def server_env(
    transport: str,
    extra: dict[str, str] | None = None,
    paths: tuple[Path, ...] = (),
    unset: tuple[str, ...] = (),
) -> dict[str, str]:
    """What a server process needs here: SGLang's CPU engine with the kernel stand-in (and
    `paths`) on the path, UCX on loopback, kvxfer's transport, nothing from a model hub;
    without the variables in `unset`."""
    env = {k: v for k, v in os.environ.items() if k not in unset}
    path = [str(HERE), *map(str, paths), *filter(None, [env.get("PYTHONPATH")])]
    env.update(
        {
            "SGLANG_USE_CPU_ENGINE": "1",
            "PYTHONPATH": os.pathsep.join(path),
            "SGLANG_HOST_IP": "127.0.0.1",
            "UCX_MODULES": env.get("UCX_MODULES", "^ib*"),
            "TORCHDYNAMO_DISABLE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            "KVXFER_TRANSPORT": transport,
            **(extra or {}),
        }
    )
    return env


COMMON = [
    "--skip-tokenizer-init",
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--dtype",
    "float32",
    "--max-total-tokens",
    "4096",
    "--max-running-requests",
    "8",
    "--page-size",
    "1",
    "--random-seed",
    "0",
    "--host",
    "127.0.0.1",
]


class Process:
    """A child in its own process group, its output in `logdir/name.log`."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], logdir: Path) -> None:
        self.name = name
        self.log_path = logdir / f"{name}.log"
        self.log = open(self.log_path, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            argv, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        LIVE.append(self)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def kill(self, sig: signal.Signals = signal.SIGKILL) -> None:
        """Sends `sig` to the process and every process it started."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        if self.alive():
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        self.kill(signal.SIGKILL)  # children left behind, if any
        self.proc.wait()
        self.log.close()
        if self in LIVE:
            LIVE.remove(self)


class Server(Process):
    """``sglang.launch_server`` in disaggregation `role` on `cpus`."""

    def __init__(
        self,
        role: str,
        cpus: str,
        logdir: Path,
        *,
        transport: str,
        bootstrap_port: int,
        backend: str = "kvxfer",
        name: str | None = None,
        env: dict[str, str] | None = None,
        model: Path = MODEL,
        args: tuple[str, ...] = (),
        paths: tuple[Path, ...] = (),
        unset: tuple[str, ...] = (),
    ) -> None:
        self.port = free_port()
        self.role = role
        self.bootstrap_port = bootstrap_port
        argv = [
            "taskset",
            "-c",
            cpus,
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model),
            *COMMON,
            "--port",
            str(self.port),
            "--disaggregation-mode",
            role,
            "--disaggregation-transfer-backend",
            backend,
        ]
        if role == "prefill":
            # A repeated prompt would take the cached-prefix path, which records a CUDA event.
            argv += ["--disable-radix-cache"]
            argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
        else:
            # The default backup pool registers host memory with CUDA.
            argv += ["--disaggregation-decode-retraction-backup", "none"]
        argv += args  # later flags win
        env_ = server_env(transport, env, paths, unset)
        super().__init__(name or f"{role}-{transport}", argv, env_, logdir)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Router(Process):
    """SGLang's router (``sglang_router``, its Python mini load balancer) over one pair."""

    def __init__(self, prefill: Server, decode: Server, logdir: Path, name: str) -> None:
        self.port = free_port()
        argv = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--pd-disaggregation",
            "--mini-lb",
            "--prefill",
            prefill.url,
            str(prefill.bootstrap_port),
            "--decode",
            decode.url,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        super().__init__(name, argv, server_env("ucx"), logdir)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def wait_healthy(procs: list[Any], timeout: float) -> None:
    """Waits until every process answers ``/health``; raises with the log's tail if one
    exits or the time runs out."""
    deadline = time.monotonic() + timeout
    waiting = list(procs)
    while waiting:
        for p in list(waiting):
            if not p.alive():
                raise AssertionError(f"{p.name} exited:\n{p.log_text()[-3000:]}")
            try:
                if requests.get(f"{p.url}/health", timeout=5).status_code == 200:
                    waiting.remove(p)
            except requests.RequestException:
                pass
        if waiting and time.monotonic() > deadline:
            names = ", ".join(p.name for p in waiting)
            raise AssertionError(f"not healthy within {timeout} s: {names}")
        time.sleep(0.5)


def body(ids: list[int], room: int | None = None, boot: int | None = None, **kw: Any) -> dict:
    """A greedy generate request for `ids`, with logprobs; `room` and `boot` address a
    prefill directly (the router adds them itself)."""
    b: dict[str, Any] = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": kw.pop("max_new_tokens", 8)},
        "return_logprob": True,
    }
    if room is not None:
        b.update(bootstrap_host="127.0.0.1", bootstrap_port=boot, bootstrap_room=room)
    b.update(kw)
    return b


def post(url: str, b: dict, timeout: float = 120) -> requests.Response:
    return requests.post(f"{url}/generate", json=b, timeout=timeout)


def tokens_and_logprobs(reply: dict) -> tuple[list[int], list[float]]:
    lp = reply["meta_info"]["output_token_logprobs"]
    return reply["output_ids"], [float(x[0]) for x in lp]


LOGPROB_TOLERANCE = 1e-4


def assert_matches(reply: dict, ref: dict) -> None:
    """`reply` has the plain run's tokens, and its logprobs within `LOGPROB_TOLERANCE`."""
    ids, lps = tokens_and_logprobs(reply)
    assert ids == ref["output_ids"]
    assert np.allclose(lps, ref["logprobs"], atol=LOGPROB_TOLERANCE, rtol=0), (lps, ref["logprobs"])


def ended_in_error(r: requests.Response) -> bool:
    """Whether a generate request failed or was aborted."""
    if r.status_code != 200:
        return True
    finish = r.json().get("meta_info", {}).get("finish_reason") or {}
    return finish.get("type") == "abort"


def deferred_releases(decode_url: str) -> dict[str, float]:
    """SGLang's count of the decode's deferred page releases, by outcome (``drained``: every
    writer acknowledged; ``timeout``: released without; needs ``--enable-metrics``)."""
    text = requests.get(f"{decode_url}/metrics", timeout=5).text
    found: dict[str, float] = {}
    for m in re.finditer(
        r'^sglang:decode_deferred_kv_release_total\{[^}]*outcome="(\w+)"[^}]*\} (\S+)$',
        text,
        re.M,
    ):
        found[m.group(1)] = found.get(m.group(1), 0.0) + float(m.group(2))
    return found


def direct(
    prefill: Server, decode: Server, p_ids: list[int], d_ids: list[int], room: int
) -> tuple[requests.Response, requests.Response]:
    """Posts `p_ids` to the prefill and `d_ids` to the decode under one room, side by side
    (the router's way, without the router)."""
    out: dict[str, requests.Response] = {}

    def go(name: str, s: Server, ids: list[int]) -> None:
        out[name] = post(s.url, body(ids, room, prefill.bootstrap_port))

    ts = [
        threading.Thread(target=go, args=("p", prefill, p_ids)),
        threading.Thread(target=go, args=("d", decode, d_ids)),
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out["p"], out["d"]


def baseline(prompts: list[list[int]], logdir: Path, timeout: float = 900) -> list[dict]:
    """Greedy tokens and logprobs of `prompts` from a plain (not disaggregated) SGLang engine,
    run offline in a child process."""
    out = logdir / "baseline.json"
    with open(logdir / "baseline.log", "ab") as log:
        subprocess.run(
            [sys.executable, str(HERE / "baseline.py"), str(MODEL), json.dumps(prompts), str(out)],
            env=server_env("ucx"),
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            check=True,
        )
    return json.loads(out.read_text())
