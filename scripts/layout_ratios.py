"""Prints kvxfer layout planning figures and their ratios to the Python peers.

Usage: layout_ratios.py CRITERION_DIR PEER_OUTPUT_DIR
Reads criterion's mean estimates and the peers' printed per-request times (median of runs)."""
import json
import re
import statistics
import sys
from pathlib import Path

crit, peer_dir = Path(sys.argv[1]), Path(sys.argv[2])


def mean_us(name):
    f = crit / name / "new" / "estimates.json"
    return json.loads(f.read_text())["mean"]["point_estimate"] / 1e3 if f.exists() else None


def peer_ms(file, pattern):
    p = peer_dir / file
    if not p.exists():
        return []
    return [float(m) for m in re.findall(pattern, p.read_text())]


ids = mean_us("desc_ids_llama8b")
nhd = mean_us("nhd_hetero_tp/coalesced")
nhd_reused = mean_us("nhd_hetero_tp/coalesced_reused_buffer")
s128, s1280 = mean_us("plan_scaling/128"), mean_us("plan_scaling/1280")
print(f"kvxfer desc ids (8192): {ids:.2f} us")
print(f"kvxfer NHD 8->4 plan (131072 raw): {nhd:.1f} us fresh, {nhd_reused:.1f} us reusing its buffer")
print(f"plan scaling 10x blocks: {s1280 / s128:.2f}x time (target <= 12x)")
vllm = peer_ms("peer_vllm.txt", r"desc_ids=([0-9.]+)ms")
totals = peer_ms("peer_sglang.txt", r"numpy\+nixl total=([0-9.]+)ms")
nixl = peer_ms("peer_sglang.txt", r"get_xfer_descs ([0-9.]+)ms")
if vllm:
    med = statistics.median(vllm)
    print(f"vLLM-style python desc ids: median {med:.2f} ms -> kvxfer {med * 1e3 / ids:.0f}x faster (target >= 50x)")
if totals:
    numpy = [t - n for t, n in zip(totals, nixl)]
    med, best = statistics.median(numpy), min(numpy)
    print(
        f"SGLang-style numpy descriptors: median {med:.2f} ms, best {best:.2f} ms -> kvxfer "
        f"{med * 1e3 / nhd_reused:.0f}x (median) / {best * 1e3 / nhd_reused:.0f}x (best) faster (target >= 50x)"
    )
    medt = statistics.median(totals)
    print(f"  with NIXL list creation: median {medt:.2f} ms -> {medt * 1e3 / nhd_reused:.0f}x")
