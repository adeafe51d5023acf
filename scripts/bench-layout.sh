#!/usr/bin/env bash
# Runs the layout planning benchmarks and the Python peers back to back on this machine,
# then prints kvxfer's speed-up over each peer and the planning scaling ratio.
# Usage: scripts/bench-layout.sh [--quick]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
peers="$root/../shared/peers"
out="$root/target/bench-layout"
mkdir -p "$out"
time_args=()
[ "${1:-}" = "--quick" ] && time_args=(--warm-up-time 1 --measurement-time 3)
cargo bench -p kvxfer-layout --bench plan -- "${time_args[@]}" | tee "$out/criterion.txt"
if [ -d "$peers" ]; then
    scripts/nixl-venv.sh > "$out/env.sh"
    # The peers need only the Python package; the env is harmless.
    (cd "$peers" && "$root/.venv-nixl/bin/python" vllm_style_nixl_bench.py 32 256 128) | tee "$out/peer_vllm.txt"
    (cd "$peers" && "$root/.venv-nixl/bin/python" sglang_slice_cost.py) | tee "$out/peer_sglang.txt"
else
    echo "no ../shared/peers: printing kvxfer figures only" >&2
fi
python3 scripts/layout_ratios.py "$root/target/criterion" "$out"
