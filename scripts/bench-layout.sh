#!/usr/bin/env bash
# Runs the layout planning benchmarks and the Python peers back to back on this machine,
# then prints kvxfer's speed-up over each peer and the planning scaling ratio.
# Usage: scripts/bench-layout.sh [--quick | --smoke]
#   --quick  shorter criterion runs (1 s warm-up, 3 s measurement)
#   --smoke  a few iterations only, to check the script end to end (figures are not meaningful)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
peers="$root/../shared/peers"
out="$root/target/bench-layout"
mkdir -p "$out"
time_args=()
case "${1:-}" in
    --quick) time_args=(--warm-up-time 1 --measurement-time 3) ;;
    --smoke) time_args=(--warm-up-time 0.05 --measurement-time 0.1 --sample-size 10) ;;
    "") ;;
    *) echo "usage: scripts/bench-layout.sh [--quick | --smoke]" >&2; exit 2 ;;
esac
# The workspace's features, as every benchmark script selects them: one release build serves
# them all (a selection of its own would rebuild the dependencies whose features it changes).
cargo bench --workspace --all-features --bench plan -- "${time_args[@]}" | tee "$out/criterion.txt"
if [ -d "$peers" ]; then
    # The peers import NIXL, whose bundled UCX needs nixl-venv.sh's environment (without it
    # the IB modules load a second libnl and the interpreter crashes at exit).
    eval "$(scripts/nixl-venv.sh)"
    (cd "$peers" && "$root/.venv-nixl/bin/python" vllm_style_nixl_bench.py 32 256 128) | tee "$out/peer_vllm.txt"
    (cd "$peers" && "$root/.venv-nixl/bin/python" sglang_slice_cost.py) | tee "$out/peer_sglang.txt"
else
    echo "no ../shared/peers: printing kvxfer figures only" >&2
    rm -f "$out/peer_vllm.txt" "$out/peer_sglang.txt"
fi
python3 scripts/layout_ratios.py "$root/target/criterion" "$out"
