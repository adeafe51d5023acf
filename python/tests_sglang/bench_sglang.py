"""kvxfer's SGLang backend against SGLang's own nixl backend, on the same SGLang, in one run.

For each backend a prefill server (core 0), a decode server (core 1) and SGLang's router start
with a model of Llama-3-8B's KV geometry (32 layers, 8 KV heads, head dim 128, bf16: 128 KiB of
KV per token; make_model.py's ``llama8b-kv``). After a warm-up request, each of `--requests`
prompts of `--tokens` tokens goes through the router with one new token, one at a time:

- time to first token: request sent to the decoded token back (prefill, transfer, decode);
- transfer: SGLang's own accounting of each request's KV transfer on the prefill
  (``sglang:kv_transfer_latency_ms`` and ``_total_mb`` from ``/metrics``: bytes of the pages
  sent, first send to the poll that sees the room complete), the same code for every backend;
- CPU time: user + system time of every process of the two servers, per request (model compute
  is the same for every backend; the difference is the backend's).

Ratios are against the nixl backend measured in the same run. Nothing is asserted on time.
``--smoke``: the tests' tiny fp32 model, two 128-token requests, SGLang's nixl backend only (a
check that the benchmark and its baseline run, not a measurement: kvxfer's backend runs the
same code path in the SGLang suite, the baseline nowhere else, and each backend's servers take
about a minute to start on a CI machine).
Usage: bench_sglang.py [--smoke] [--requests N] [--tokens T] [--backends LIST] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
from harness import HERE, NIXL_DRAM, NIXL_ENV, Router, Server, body, free_port, post, wait_healthy
from harness import MODEL as TINY

MODEL = Path(sys.prefix) / "models" / "llama8b-kv"
BACKENDS = {
    # name: (SGLang backend, kvxfer transport or None)
    "sglang-nixl": ("nixl", None),
    "kvxfer-ucx": ("kvxfer", "ucx"),
    "kvxfer-nixl": ("kvxfer", "nixl"),
}


def ensure_model() -> None:
    if not (MODEL / "model.safetensors").exists():
        make = HERE.parent / "tests_vllm" / "make_model.py"
        subprocess.run(
            [sys.executable, str(make), str(MODEL), "--preset", "llama8b-kv"], check=True
        )


def cpu_seconds(pgids: list[int]) -> float:
    """User + system CPU time of every live process in the process groups `pgids`."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[2]) in pgids:  # pgrp
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def transfer_sums(url: str) -> tuple[float, float, float]:
    """(latency ms sum, MiB sum, count) of the prefill's KV transfers so far."""
    text = requests.get(f"{url}/metrics", timeout=10).text

    def value(name: str) -> float:
        m = re.search(rf"^sglang:{name}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    return (
        value("kv_transfer_latency_ms_sum"),
        value("kv_transfer_total_mb_sum"),
        value("kv_transfer_latency_ms_count"),
    )


def run_backend(
    name: str, requests_n: int, tokens: int, logdir: Path, model: Path, dtype: str
) -> dict[str, Any]:
    backend, transport = BACKENDS[name]
    boot = free_port()
    max_tokens = str(tokens * 4 + 512)
    args = ("--dtype", dtype, "--max-total-tokens", max_tokens, "--enable-metrics")
    kw: dict[str, Any] = {"backend": backend, "model": model, "args": args}
    if transport is None:  # SGLang's nixl backend, with its host memory labelled as such
        kw.update(paths=(NIXL_DRAM,), unset=NIXL_ENV)
    t = transport or "ucx"
    p = Server("prefill", "0", logdir, transport=t, bootstrap_port=boot, name=f"p-{name}", **kw)
    d = Server("decode", "1", logdir, transport=t, bootstrap_port=boot, name=f"d-{name}", **kw)
    procs: list[Any] = [p, d]
    try:
        wait_healthy([p, d], 1500)
        r = Router(p, d, logdir, f"router-{name}")
        procs.append(r)
        wait_healthy([r], 120)
        rng = random.Random(0)
        prompts = [[rng.randrange(1000) for _ in range(tokens)] for _ in range(requests_n + 1)]
        warm = post(r.url, body(prompts[0], max_new_tokens=1), timeout=600)
        assert warm.status_code == 200, warm.text
        lat0, mb0, n0 = transfer_sums(p.url)
        cpu0 = cpu_seconds([p.proc.pid, d.proc.pid])
        ttft = []
        for ids in prompts[1:]:
            start = time.perf_counter()
            reply = post(r.url, body(ids, max_new_tokens=1), timeout=600)
            ttft.append(time.perf_counter() - start)
            assert reply.status_code == 200, reply.text
        cpu = cpu_seconds([p.proc.pid, d.proc.pid]) - cpu0
        lat1, mb1, n1 = transfer_sums(p.url)
    finally:
        for proc in reversed(procs):
            proc.close()
    n = max(n1 - n0, 1)
    return {
        "backend": name,
        "requests": requests_n,
        "tokens": tokens,
        "ttft_s": sorted(ttft)[len(ttft) // 2],
        "transfer_ms": (lat1 - lat0) / n,
        "transfer_gb_s": (mb1 - mb0) / 1024 / max((lat1 - lat0) / 1000, 1e-9),
        "transfer_mib": (mb1 - mb0) / n,
        "transfers_counted": n1 - n0,
        "cpu_s_per_request": cpu / requests_n,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    model, dtype = MODEL, "bfloat16"
    if a.smoke:
        model, dtype = TINY, "float32"
        a.requests, a.tokens, a.backends = 2, 128, "sglang-nixl"
    else:
        ensure_model()
    logdir = Path(tempfile.mkdtemp(prefix="bench-sglang-"))
    print(f"server logs: {logdir}", flush=True)
    results = []
    for name in a.backends.split(","):
        res = run_backend(name, a.requests, a.tokens, logdir, model, dtype)
        results.append(res)
        print(json.dumps(res), flush=True)
    base = next((r for r in results if r["backend"] == "sglang-nixl"), None)
    print(
        f"\n{a.tokens}-token prompts, {a.requests} requests each "
        f"({model.name}, {dtype}, {results[0]['transfer_mib']:.0f} MiB of KV per request)"
    )
    print(
        f"{'backend':<13} {'TTFT ms':>9} {'transfer ms':>12} {'GB/s':>7} {'CPU s/req':>10}"
        + ("   transfer x  TTFT x  CPU x" if base else "")
    )
    for r in results:
        line = (
            f"{r['backend']:<13} {r['ttft_s'] * 1000:>9.0f} {r['transfer_ms']:>12.1f} "
            f"{r['transfer_gb_s']:>7.2f} {r['cpu_s_per_request']:>10.2f}"
        )
        if base:
            line += (
                f"   {base['transfer_ms'] / r['transfer_ms']:>10.2f}"
                f"  {base['ttft_s'] / r['ttft_s']:>6.2f}"
                f"  {base['cpu_s_per_request'] / r['cpu_s_per_request']:>5.2f}"
            )
        print(line)
    if a.out:
        a.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
