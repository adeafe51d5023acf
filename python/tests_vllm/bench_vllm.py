"""KvxferConnector against vLLM's own NixlConnector, side by side in one run, on the same vLLM,
model, prompts and machine: a prefill and a decode engine per connector (the prefill engine
on core 0, the decode engine on core 1: harness.pinned), pull mode, both connectors
instrumented the same way (timed_connectors).

Per connector: the prefill computes the prompts once (warm-up, with prefix caching on, so
later batches cost it one block each), the decode pulls one warm-up batch (handshakes), then
`--batches` measured batches of `--requests` concurrent requests, each pulling every prompt
block. Reported per request: decode-side time from submission to KV loaded (the worker's
`finished_recving`), time to first token, bytes moved, and connector CPU time (the scheduler
and worker halves on both engines: time inside connector calls plus the connector's threads).
The decode's tokens must be the same under both connectors.

Usage: bench_vllm.py [--model DIR] [--prompt-len 2048] [--requests 4] [--batches 5]
    [--transport ucx|nixl] [--json OUT] [--smoke]
"""

import argparse
import json
import math
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from flows import BLOCK, prompt
from harness import MODELS, Engine, free_port, start
from timed_connectors import collect

CONNECTORS = {
    "nixl": ("NixlConnector", "timed_connectors"),
    "kvxfer": ("KvxferConnector", "timed_connectors"),
}


def kv_bytes_per_token(model: Path, dtype_size: int) -> int:
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * dtype_size


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def thread_deltas(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """CPU milliseconds per connector thread between two snapshots (the busy ones)."""
    d = {t: (ns - a["by_thread"].get(t, 0)) / 1e6 for t, ns in b["by_thread"].items()}
    return {t: round(ms, 3) for t, ms in d.items() if ms >= 0.01}


def loaded_at(loaded: dict[str, float], req_id: str) -> float:
    """When the worker reported `req_id` loaded; the engine core may have suffixed the id."""
    hits = [t for r, t in loaded.items() if r == req_id or r.startswith(req_id + "-")]
    assert len(hits) == 1, f"{req_id}: {len(hits)} load reports in {sorted(loaded)}"
    return hits[0]


def run_connector(name: str, a: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    cls = CONNECTORS[name]
    opts = {"dtype": a.dtype, "max_model_len": a.prompt_len + 64, "max_num_seqs": a.requests}
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(a.kv_cache_gib),
        "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "3600",
        **({"UCX_TLS": a.kvxfer_ucx_tls} if a.kvxfer_ucx_tls and name == "kvxfer" else {}),
    }
    stats: dict[str, Path] = {}

    def extra(port: int) -> dict[str, Any]:
        if name == "nixl":
            return {"kv_lease_duration": 600}
        return {
            "transport": a.transport,
            "side_channel_port": port,
            "lease": 600,
            "ucx_library": a.kvxfer_ucx_library,
        }

    def engine(role: str, cpus: str, prefix_caching: bool) -> Engine:
        port = free_port()
        stats[role] = logdir / f"stats-{role}-{name}"
        stats[role].mkdir()
        return Engine(
            f"{role}-{name}",
            cpus,
            extra(port),
            logdir,
            model=a.model,
            opts={**opts, "prefix_caching": prefix_caching},
            connector=cls,
            env={
                **env,
                # vLLM's default layout (EngineCore in a process of its own), as measured.
                "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port),
                "KVXFER_BENCH_STATS": str(stats[role]),
            },
        )

    # The prefill caches prefixes (later batches cost it one block each); the decode does not,
    # so that it loads every block.
    p, d = start([engine("prefill", "0", True), engine("decode", "1", False)], timeout=900)
    try:
        # Each instrumented process (EngineCore: scheduler half; worker) has answered once.
        procs = {r: len(list(dir.glob("*.json"))) for r, dir in stats.items()}
        prompts = [prompt(i, a.prompt_len) for i in range(a.requests)]

        def prefill() -> list[Any]:
            reqs = [{"prompt": x, "params": {"do_remote_decode": True}} for x in prompts]
            out = p.call({"op": "generate", "max_tokens": 1, "requests": reqs}, timeout=3600)
            return [o["params"] for o in out]

        def decode(params: list[Any]) -> list[Any]:
            reqs = [{"prompt": x, "params": q} for x, q in zip(prompts, params, strict=True)]
            return d.call({"op": "generate", "max_tokens": 1, "requests": reqs}, timeout=600)

        t0 = time.monotonic()
        warm = decode(prefill())
        print(
            f"{name}: warm-up (prefill of {a.requests} × {a.prompt_len} tokens and first "
            f"hand-off) {time.monotonic() - t0:.1f} s",
            file=sys.stderr,
        )
        assert all(o["finish"] == "length" for o in warm), warm
        requests: list[dict[str, Any]] = []
        batches: list[dict[str, Any]] = []
        for b in range(a.batches):
            sp0 = collect(stats["prefill"], procs["prefill"])
            params = prefill()
            sd0 = collect(stats["decode"], procs["decode"])
            ext0 = d.call({"op": "external_tokens"})
            out = decode(params)
            sd1 = collect(stats["decode"], procs["decode"])
            sp1 = collect(stats["prefill"], procs["prefill"])
            ext = d.call({"op": "external_tokens"}) - ext0
            per_req_tokens = ext / a.requests
            moved = math.ceil(per_req_tokens / BLOCK) * BLOCK * a.bytes_per_token
            loads = []
            for o in out:
                assert o["finish"] == "length", o
                loaded = loaded_at(sd1["loaded"], o["engine_request_id"])
                loads.append(loaded)
                requests.append(
                    {
                        "batch": b,
                        "load_s": loaded - o["submitted"],
                        "ttft_s": o["first_token"] - o["submitted"],
                        "bytes": moved,
                        "tokens": o["tokens"],
                    }
                )
            cpu_d = sd1["in_calls_ns"] + sd1["threads_ns"] - sd0["in_calls_ns"] - sd0["threads_ns"]
            cpu_p = sp1["in_calls_ns"] + sp1["threads_ns"] - sp0["in_calls_ns"] - sp0["threads_ns"]
            span = max(loads) - min(o["submitted"] for o in out)
            batches.append(
                {
                    "external_tokens": ext,
                    "bytes": moved * a.requests,
                    "span_s": span,
                    "gbps": moved * a.requests / span / 1e9,
                    "cpu_decode_ms_per_req": cpu_d / 1e6 / a.requests,
                    "cpu_prefill_ms_per_req": cpu_p / 1e6 / a.requests,
                    "processes": [sd1["roles"], sp1["roles"]],
                    "thread_ms_decode": thread_deltas(sd0, sd1),
                    "thread_ms_prefill": thread_deltas(sp0, sp1),
                }
            )
        ucx = re.findall(r"kvxfer: UCX (\S+)", d.log_text())
        return {"requests": requests, "batches": batches, "ucx": ucx[0] if ucx else None}
    finally:
        p.close()
        d.close()


def summarize(r: dict[str, Any]) -> dict[str, float]:
    loads = [x["load_s"] for x in r["requests"]]
    ttft = [x["ttft_s"] for x in r["requests"]]
    bs = r["batches"]
    cpu_d = statistics.median(b["cpu_decode_ms_per_req"] for b in bs)
    cpu_p = statistics.median(b["cpu_prefill_ms_per_req"] for b in bs)
    return {
        "load_p50_s": pct(loads, 50),
        "load_p99_s": pct(loads, 99),
        "ttft_p50_s": pct(ttft, 50),
        "gbps_median": statistics.median(b["gbps"] for b in bs),
        "mib_per_request": r["requests"][0]["bytes"] / 2**20,
        "cpu_decode_ms_per_req": cpu_d,
        "cpu_prefill_ms_per_req": cpu_p,
        "cpu_ms_per_req": cpu_d + cpu_p,
        "samples": len(loads),
    }


def workload_parser(doc: str, batches: int, kv_cache_gib: int) -> argparse.ArgumentParser:
    """The options both vLLM benchmarks share: the model, prompts and batches, the engines'
    KV cache, where the JSON goes, and `--smoke` (see `parse_workload`)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", type=Path, default=MODELS / "llama8b-kv")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--batches", type=int, default=batches)
    ap.add_argument("--kv-cache-gib", type=int, default=kv_cache_gib)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 × 100 tokens, 1 batch")
    return ap


def parse_workload(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """Parses the command line; `--smoke` replaces the workload by the tiny model's."""
    a = ap.parse_args()
    if a.smoke:
        a.model, a.dtype, a.prompt_len, a.requests, a.batches = (
            MODELS / "tiny-llama",
            "float32",
            100,
            2,
            1,
        )
        a.kv_cache_gib = 1
    return a


def main() -> int:
    ap = workload_parser(__doc__, batches=5, kv_cache_gib=2)
    ap.add_argument("--transport", default="ucx", choices=["ucx", "nixl"])
    ap.add_argument(
        "--kvxfer-ucx-tls",
        help="UCX_TLS for kvxfer's engines, e.g. sm,self (NIXL's UCX refuses sm,self: it "
        "needs a transport with peer failure handling, so NIXL keeps UCX's defaults)",
    )
    ap.add_argument(
        "--kvxfer-ucx-library",
        default="auto",
        help="the UCX kvxfer's engines open (extra-config ucx_library): auto (a NIXL wheel's "
        "bundled UCX when installed), system, nixl, or a path",
    )
    a = parse_workload(ap)
    a.bytes_per_token = kv_bytes_per_token(a.model, 2 if a.dtype == "bfloat16" else 4)
    logdir = Path(tempfile.mkdtemp(prefix="kvxfer-bench-vllm-"))
    print(f"engine logs: {logdir}", file=sys.stderr)
    results = {name: run_connector(name, a, logdir) for name in CONNECTORS}
    n, k = (summarize(results[c]) for c in ("nixl", "kvxfer"))
    # The same prompts and model: the decode must produce the same tokens under both.
    same = [x["tokens"] for x in results["nixl"]["requests"]] == [
        x["tokens"] for x in results["kvxfer"]["requests"]
    ]
    ratios = {
        "load_p50": n["load_p50_s"] / k["load_p50_s"],
        "load_p99": n["load_p99_s"] / k["load_p99_s"],
        "throughput": k["gbps_median"] / n["gbps_median"],
        "cpu_per_request": n["cpu_ms_per_req"] / k["cpu_ms_per_req"],
    }
    print(
        f"\n{a.requests} concurrent requests × {a.batches} batches, {a.prompt_len}-token prompts, "
        f"{n['mib_per_request']:.0f} MiB of KV each ({a.model.name}, {a.dtype}); "
        f"kvxfer over {a.transport} (UCX {results['kvxfer']['ucx'] or 'via NIXL'}); "
        f"UCX_TLS={a.kvxfer_ucx_tls or '(UCX default)'}"
    )
    print("| | NixlConnector | KvxferConnector | ratio |")
    print("|---|---|---|---|")
    rows = [
        ("submission → KV loaded, p50 (ms)", "load_p50_s", 1e3, ratios["load_p50"]),
        ("submission → KV loaded, p99 (ms)", "load_p99_s", 1e3, ratios["load_p99"]),
        (
            "submission → first token, p50 (ms)",
            "ttft_p50_s",
            1e3,
            n["ttft_p50_s"] / k["ttft_p50_s"],
        ),
        ("transfer throughput (GB/s, median batch)", "gbps_median", 1, ratios["throughput"]),
        ("connector CPU per request, decode (ms)", "cpu_decode_ms_per_req", 1, None),
        ("connector CPU per request, prefill (ms)", "cpu_prefill_ms_per_req", 1, None),
        ("connector CPU per request, both (ms)", "cpu_ms_per_req", 1, ratios["cpu_per_request"]),
    ]
    for label, key, scale, ratio in rows:
        rs = f"{ratio:.2f}×" if ratio is not None else ""
        print(f"| {label} | {n[key] * scale:.2f} | {k[key] * scale:.2f} | {rs} |")
    print(f"samples per connector: {k['samples']}; same tokens under both connectors: {same}")
    report = {
        "args": {k2: str(v) for k2, v in vars(a).items()},
        "nixl": n,
        "kvxfer": k,
        "ratios": ratios,
        "same_tokens": same,
        "raw": results,
    }
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
