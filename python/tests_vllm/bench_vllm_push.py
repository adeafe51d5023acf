"""vLLM's push flow side by side in one run, on the same vLLM, model, prompts and machine:
KvxferPushConnector streaming layer by layer, KvxferPushConnector writing after the step
(`layerwise: false`), vLLM's own NixlPushConnector, and KvxferConnector pulling. A prefill and a
decode engine per configuration (the prefill on core 0, the decode on core 1), every
connector instrumented the same way (timed_connectors).

Per configuration: one short warm-up hand-off (handshakes), then `--batches` batches of
`--requests` concurrent requests with new prompts each (the prefill computes every prompt:
no prefix caching). Push: the decode gets the batch first, then the prefill (as a router
does); pull: the prefill, then the decode with the params it returned. Reported per request:
- prefill submission → decode first token;
- exposed transfer: from the prefill's forward pass ending (its first token) to the KV
  complete on the decode (the decode worker's `finished_recving`): the part of the transfer
  not hidden behind the prefill's compute (negative: complete before the prefill's step
  returned its token);
- connector CPU per request (both engines, both halves, the connectors' threads).
The decode's first tokens must be the same under every configuration.

Usage: bench_vllm_push.py [--model DIR] [--prompt-len 2048] [--requests 4] [--batches 3]
    [--json OUT] [--smoke]
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_vllm import kv_bytes_per_token, loaded_at, parse_workload, pct, workload_parser
from flows import prompt
from harness import Engine, free_port, start
from timed_connectors import collect

# name -> (connector class in timed_connectors, flow, extra config)
CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "kvxfer-push": ("KvxferPushConnector", "push", {"layerwise": True}),
    "kvxfer-push-after": ("KvxferPushConnector", "push", {"layerwise": False}),
    "nixl-push": ("NixlPushConnector", "push", {}),
    "kvxfer-pull": ("KvxferConnector", "pull", {"lease": 600}),
}


def run_config(name: str, a: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    cls, flow, config_extra = CONFIGS[name]
    opts = {"dtype": a.dtype, "max_model_len": a.prompt_len + 64, "max_num_seqs": a.requests}
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(a.kv_cache_gib),
        "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "3600",
    }
    stats: dict[str, Path] = {}
    ports: dict[str, int] = {}

    def engine(role: str, cpus: str) -> Engine:
        port = ports[role] = free_port()
        stats[role] = logdir / f"stats-{role}-{name}"
        stats[role].mkdir()
        extra: dict[str, Any] = (
            {"kv_lease_duration": 600}
            if cls.startswith("Nixl")
            else {"transport": "ucx", "side_channel_port": port, **config_extra}
        )
        return Engine(
            f"{role}-{name}",
            cpus,
            extra,
            logdir,
            model=a.model,
            opts=opts,
            connector=(cls, "timed_connectors"),
            env={
                **env,
                "VLLM_ENABLE_V1_MULTIPROCESSING": "1",  # vLLM's default layout, as measured
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port),
                "KVXFER_BENCH_STATS": str(stats[role]),
            },
        )

    p, d = start([engine("prefill", "0"), engine("decode", "1")], timeout=900)
    host = "localhost" if cls.startswith("Nixl") else "127.0.0.1"
    batch_no = [0]
    try:
        procs = {r: len(list(dir.glob("*.json"))) for r, dir in stats.items()}

        def handoff(prompts: list[list[int]]) -> tuple[list[Any], list[Any]]:
            """The prefill's and the decode's outputs for `prompts`, in this flow."""
            n = batch_no[0]
            batch_no[0] += 1
            if flow == "pull":
                reqs = [{"prompt": x, "params": {"do_remote_decode": True}} for x in prompts]
                p_out = p.call({"op": "generate", "max_tokens": 1, "requests": reqs}, timeout=3600)
                d_reqs = [
                    {"prompt": x, "params": o["params"]}
                    for x, o in zip(prompts, p_out, strict=True)
                ]
                d_out = d.call(
                    {"op": "generate", "max_tokens": 1, "requests": d_reqs}, timeout=3600
                )
                return p_out, d_out
            ids = [f"b{n}-{i}" for i in range(len(prompts))]
            d.send(
                {
                    "op": "generate",
                    "max_tokens": 1,
                    "requests": [
                        {
                            "id": i,
                            "prompt": x,
                            "params": {
                                "do_remote_prefill": True,
                                "remote_engine_id": f"kvxfer-test-prefill-{name}",
                                "remote_request_id": i,
                                "remote_host": host,
                                "remote_port": ports["prefill"],
                                "tp_size": 1,
                            },
                        }
                        for i, x in zip(ids, prompts, strict=True)
                    ],
                }
            )
            p_out = p.call(
                {
                    "op": "generate",
                    "max_tokens": 1,
                    "requests": [
                        {"id": i, "prompt": x, "params": {"do_remote_decode": True}}
                        for i, x in zip(ids, prompts, strict=True)
                    ],
                },
                timeout=3600,
            )
            return p_out, d.wait(3600)

        t0 = time.monotonic()
        warm_p, warm_d = handoff([prompt(9999, 64)])
        assert warm_d[0]["finish"] == "length", warm_d
        print(f"{name}: warm-up {time.monotonic() - t0:.1f} s", file=sys.stderr)
        requests: list[dict[str, Any]] = []
        for b in range(a.batches):
            prompts = [prompt(1000 * (b + 1) + i, a.prompt_len) for i in range(a.requests)]
            s0 = {r: collect(stats[r], procs[r]) for r in stats}
            p_out, d_out = handoff(prompts)
            s1 = {r: collect(stats[r], procs[r]) for r in stats}
            cpu = sum(
                s1[r]["in_calls_ns"]
                + s1[r]["threads_ns"]
                - s0[r]["in_calls_ns"]
                - s0[r]["threads_ns"]
                for r in stats
            )
            for po, do in zip(p_out, d_out, strict=True):
                assert do["finish"] == "length", do
                loaded = loaded_at(s1["decode"]["loaded"], do["engine_request_id"])
                requests.append(
                    {
                        "batch": b,
                        "first_token_s": do["first_token"] - po["submitted"],
                        "exposed_s": loaded - po["first_token"],
                        "cpu_ms": cpu / 1e6 / a.requests,
                        "tokens": do["tokens"],
                    }
                )
        return {"requests": requests}
    finally:
        p.close()
        d.close()


def summarize(r: dict[str, Any]) -> dict[str, float]:
    ft = [x["first_token_s"] for x in r["requests"]]
    ex = [x["exposed_s"] for x in r["requests"]]
    return {
        "first_token_p50_s": pct(ft, 50),
        "first_token_p99_s": pct(ft, 99),
        "exposed_p50_s": pct(ex, 50),
        "exposed_p99_s": pct(ex, 99),
        "cpu_ms_per_req": statistics.median(x["cpu_ms"] for x in r["requests"]),
        "samples": len(ft),
    }


def main() -> int:
    ap = workload_parser(__doc__, batches=3, kv_cache_gib=3)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="which, comma-separated")
    a = parse_workload(ap)
    names = a.configs.split(",")
    logdir = Path(tempfile.mkdtemp(prefix="kvxfer-bench-vllm-push-"))
    print(f"engine logs: {logdir}", file=sys.stderr)
    results = {n: run_config(n, a, logdir) for n in names}
    s = {n: summarize(r) for n, r in results.items()}
    tokens = {n: [x["tokens"] for x in r["requests"]] for n, r in results.items()}
    same = len({json.dumps(t) for t in tokens.values()}) == 1
    mib = a.prompt_len * kv_bytes_per_token(a.model, 2 if a.dtype == "bfloat16" else 4) / 2**20
    print(
        f"\n{a.requests} concurrent requests × {a.batches} batches, {a.prompt_len}-token prompts "
        f"({mib:.0f} MiB of KV each, {a.model.name}, {a.dtype}), UCX"
    )
    print("| | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    rows = [
        ("prefill submission → decode first token, p50 (ms)", "first_token_p50_s", 1e3),
        ("prefill submission → decode first token, p99 (ms)", "first_token_p99_s", 1e3),
        ("exposed transfer, p50 (ms)", "exposed_p50_s", 1e3),
        ("exposed transfer, p99 (ms)", "exposed_p99_s", 1e3),
        ("connector CPU per request, both engines (ms)", "cpu_ms_per_req", 1),
    ]
    for label, key, scale in rows:
        print(f"| {label} | " + " | ".join(f"{s[n][key] * scale:.1f}" for n in names) + " |")
    ratios: dict[str, float] = {}
    if {"kvxfer-push", "nixl-push"} <= s.keys():
        ratios["first_token_p50_vs_nixl_push"] = (
            s["nixl-push"]["first_token_p50_s"] / s["kvxfer-push"]["first_token_p50_s"]
        )
    if {"kvxfer-push", "kvxfer-push-after"} <= s.keys():
        after = s["kvxfer-push-after"]["exposed_p50_s"]
        ratios["exposed_p50_vs_after_the_step"] = (
            s["kvxfer-push"]["exposed_p50_s"] / after if after > 0 else float("nan")
        )
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")
    print(f"samples per configuration: {s[names[0]]['samples']}; same first tokens: {same}")
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(a).items()},
                    "summary": s,
                    "ratios": ratios,
                    "same_tokens": same,
                    "raw": results,
                },
                indent=1,
            )
        )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
