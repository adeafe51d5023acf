#!/usr/bin/env bash
# kvxfer's pull over NIXL against the vLLM-style peer (NIXL from Python, prepared lists,
# make_prepped_xfer), run back to back ROUNDS times on this machine with the same NIXL
# runtime and the same shape: 32 layers x K/V, 256 blocks of 32 KiB per region, 128 random
# blocks per request (8192 block descriptors, 268 MB), one request at a time.
#
# Prints the medians and three ratios: steady-state throughput, per-request CPU time to build
# the request (everything before NIXL's own post call; NIXL's post is measured by its
# telemetry and, on a machine without RDMA, moves the bytes itself), and first-transfer time.
# Usage: scripts/bench-nixl.sh [ROUNDS | --smoke]
#   --smoke  one round of 2 requests, to check the script end to end (figures not meaningful)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
rounds=${1:-3}
requests=()
if [ "$rounds" = "--smoke" ]; then
    rounds=1
    requests=(--requests 2)
fi
peer="$root/../shared/peers/vllm_style_nixl_bench.py"
[ -f "$peer" ] || { echo "no $peer" >&2; exit 2; }
eval "$(scripts/nixl-venv.sh)"
# The workspace's features, as every benchmark script selects them (one release build for all).
cargo build --release --workspace --all-features --bin kvxfer -q
out="$root/target/bench-nixl"
mkdir -p "$out"
for i in $(seq 1 "$rounds"); do
    ./target/release/kvxfer bench --transport nixl --concurrency 1 "${requests[@]}" --json "$out/kvxfer-$i.json" > "$out/kvxfer-$i.txt"
    "$root/.venv-nixl/bin/python" "$peer" 32 256 128 > "$out/peer-$i.txt" 2>&1
done
python3 - "$out" "$rounds" <<'EOF'
import json, re, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
ours = [json.load(open(f"{out}/kvxfer-{i}.json")) for i in range(1, rounds + 1)]
peer_gbs, peer_build, peer_first = [], [], []
for i in range(1, rounds + 1):
    rows = re.findall(r"desc_ids=([\d.]+)ms make_prepped=([\d.]+)ms xfer=([\d.]+)ms\s+([\d.]+) GB/s",
                      open(f"{out}/peer-{i}.txt").read())
    if not rows:
        sys.exit(f"peer run {i} printed no results: see {out}/peer-{i}.txt")
    peer_first.append(float(rows[0][2]))
    for d, m, _x, g in rows[1:]:  # steady state: after the first transfer
        peer_build.append(float(d) + float(m))
        peer_gbs.append(float(g))
med = statistics.median
gbs = med(o["gb_per_s"] for o in ours)
build = med(o["post_ms_per_request"] - o["library_post_ms_per_request"] for o in ours)
plan = med(o["plan_ms_per_request"] for o in ours)
first = med(o["first_transfer_ms"] for o in ours)
print(f"{rounds} rounds back to back; medians")
print(f"  throughput     kvxfer {gbs:.2f} GB/s   peer {med(peer_gbs):.2f} GB/s   ratio {gbs / med(peer_gbs):.2f}x")
print(f"  build/request  kvxfer {build:.3f} ms (plan {plan:.3f} ms)   peer desc_ids+make_prepped {med(peer_build):.3f} ms   "
      f"ratio {med(peer_build) / build:.1f}x less")
print(f"  first transfer kvxfer {first:.1f} ms (handshake included)   peer {med(peer_first):.1f} ms   ratio {med(peer_first) / first:.1f}x faster")
EOF
