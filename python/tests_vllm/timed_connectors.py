"""Benchmark instrumentation, loaded by vLLM as the KV connector module: vLLM's own
NixlConnector and NixlPushConnector and kvxfer's KvxferConnector and KvxferPushConnector,
unchanged, with every connector call measured.

Measured per engine process (scheduler and worker halves share it on CPU with TP 1):
- `in_calls_ns`: CPU time of the calling thread inside connector methods (outermost call only,
  so a method calling another is not counted twice);
- `threads_ns`: CPU time of every thread that first appeared during a connector call (the
  connector's own threads: handshake and listener threads, NIXL's and UCX's progress threads,
  kvxfer's Rust threads), from /proc/self/task/*/schedstat;
- `loaded`: for each request, the monotonic clock when the worker first reported its KV load
  finished (`finished_recving`).

vLLM runs the scheduler half in its EngineCore process and the worker half in a worker
process, so each process answers for itself: with `KVXFER_BENCH_STATS=DIR`, a reporter
thread (not counted) writes `DIR/<pid>.json` whenever `DIR/request` names a new sequence
number; `collect` gathers the answers.
"""

import json
import os
import threading
import time
from collections.abc import Callable
from inspect import getattr_static, isfunction
from pathlib import Path
from typing import Any

_lock = threading.Lock()
_local = threading.local()
_in_calls_ns = 0
_threads: dict[str, int] = {}  # tid -> last CPU ns seen
_names: dict[str, str] = {}  # tid -> thread name
_loaded: dict[str, float] = {}
_roles: set[str] = set()
_reporter: threading.Thread | None = None


def _tids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _thread_ns(tid: str) -> int | None:
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None  # the thread ended


def _comm(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _refresh() -> None:
    for tid in list(_threads):
        ns = _thread_ns(tid)
        if ns is not None:
            _threads[tid] = ns


def snapshot() -> dict[str, Any]:
    """The totals so far; a benchmark subtracts two snapshots."""
    with _lock:
        _refresh()
        return {
            "pid": os.getpid(),
            "roles": sorted(_roles),
            "in_calls_ns": _in_calls_ns,
            "threads_ns": sum(_threads.values()),
            "threads": len(_threads),
            "by_thread": {f"{_names.get(t, '?')}/{t}": ns for t, ns in _threads.items()},
            "loaded": dict(_loaded),
        }


def _report_loop(out: Path) -> None:
    last = -1
    while True:
        try:
            seq = int((out / "request").read_text())
        except (OSError, ValueError):
            seq = 0
        if seq != last:
            tmp = out / f".{os.getpid()}.tmp"
            tmp.write_text(json.dumps({"seq": seq, **snapshot()}))
            tmp.rename(out / f"{os.getpid()}.json")
            last = seq
        time.sleep(0.02)


def _start_reporter() -> None:
    global _reporter
    out = os.environ.get("KVXFER_BENCH_STATS")
    if _reporter is not None or not out:
        return
    _reporter = threading.Thread(target=_report_loop, args=(Path(out),), daemon=True)
    _reporter.start()


def collect(out: Path, processes: int, timeout: float = 120) -> dict[str, Any]:
    """Asks every instrumented process for its totals and sums them (`loaded` is merged).
    The bound is generous: a stock NixlConnector prefill's worker was once seen to answer
    nothing (not even SIGTERM) for over 30 s right after the warm-up's first hand-off."""
    seq = int((out / "request").read_text()) + 1 if (out / "request").exists() else 1
    (out / "request").write_text(str(seq))
    deadline = time.monotonic() + timeout
    while True:
        answers = []
        for f in out.glob("*.json"):
            try:
                answers.append(json.loads(f.read_text()))
            except (OSError, ValueError):
                pass
        fresh = [a for a in answers if a["seq"] == seq]
        if len(fresh) >= processes:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(fresh)} of {processes} processes answered in {out}")
        time.sleep(0.02)
    total: dict[str, Any] = {
        "in_calls_ns": 0,
        "threads_ns": 0,
        "threads": 0,
        "loaded": {},
        "by_thread": {},
    }
    total["roles"] = sorted(r for a in fresh for r in a["roles"])
    for a in fresh:
        for k in ("in_calls_ns", "threads_ns", "threads"):
            total[k] += a[k]
        total["loaded"].update(a["loaded"])
        total["by_thread"].update({f"{a['pid']}:{t}": ns for t, ns in a["by_thread"].items()})
    return total


def _note_loaded(result: Any) -> None:
    recving = getattr(result, "finished_recving", None)
    if recving is None and isinstance(result, tuple) and len(result) == 2:
        recving = result[1]
    now = time.monotonic()
    for req_id in recving or ():
        _loaded.setdefault(str(req_id), now)


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _in_calls_ns
        depth = getattr(_local, "depth", 0)
        if depth:
            return fn(self, *args, **kwargs)
        before = _tids()
        _local.depth = 1
        t0 = time.thread_time_ns()
        try:
            result = fn(self, *args, **kwargs)
        finally:
            spent = time.thread_time_ns() - t0
            _local.depth = 0
        with _lock:
            _in_calls_ns += spent
            reporter = str(_reporter.native_id) if _reporter is not None else ""
            for tid in _tids() - before:
                if tid not in _threads and tid != reporter:
                    _threads[tid] = _thread_ns(tid) or 0
                    _names[tid] = f"{_comm(tid)} ({name})"
            if name in ("get_finished", "get_transfer_results"):
                _note_loaded(result)
            if name == "__init__":
                _start_reporter()
                role = args[1] if len(args) > 1 else kwargs.get("role")
                _roles.add(f"{getattr(role, 'name', role)}@{os.getpid()}")
        return result

    wrapper.__name__ = name
    return wrapper


def instrument(cls: type) -> type:
    """A subclass of `cls` whose own and inherited public methods (and constructor) are timed."""
    names = {"__init__"} | {
        n
        for klass in cls.__mro__
        for n in vars(klass)
        if not n.startswith("_") and isfunction(getattr_static(cls, n))
    }
    attrs = {n: _timed(n, getattr(cls, n)) for n in names}
    return type(cls.__name__, (cls,), attrs)


def __getattr__(name: str) -> type:
    # Same class names as the originals (vLLM checks for "NixlConnector" by name), imported
    # lazily: the NIXL run must not need kvxfer, nor the kvxfer run NIXL.
    if name == "NixlConnector":
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

        return instrument(NixlConnector)
    if name == "KvxferConnector":
        from kvxfer.vllm import KvxferConnector

        return instrument(KvxferConnector)
    if name == "NixlPushConnector":
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPushConnector

        return instrument(NixlPushConnector)
    if name == "KvxferPushConnector":
        from kvxfer.vllm import KvxferPushConnector

        return instrument(KvxferPushConnector)
    raise AttributeError(name)
