#!/usr/bin/env bash
# Runs every benchmark the README documents in a smoke mode: a few iterations each, so a
# benchmark or its script cannot rot unnoticed. Figures are printed, never asserted: they are
# not meaningful at this size. Part of the test command (scripts/test.sh).
# Needs the NIXL environment (scripts/test.sh --setup prints it) for the NIXL benchmarks.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
eval "$(scripts/nixl-venv.sh)"
run() { printf -- '-- %s\n' "$*"; "$@"; }

run scripts/bench-layout.sh --smoke
if [ -f "$root/../shared/peers/vllm_style_nixl_bench.py" ]; then
    run scripts/bench-nixl.sh --smoke
else
    echo "SKIP scripts/bench-nixl.sh: it compares against ../shared/peers, which is absent"
fi
# Every benchmark selects the workspace with all its features, as the two scripts above do, so
# all share one release build: a selection of its own (`-p X`, `--features`) would rebuild
# each dependency whose features it changes.
all=(--workspace --all-features)
run cargo bench -q "${all[@]}" --bench throughput -- --warm-up-time 0.05 --measurement-time 0.1
# The harness-less benchmarks take their size as the first number on the command line.
run cargo bench -q "${all[@]}" --bench pull_llama8b -- 2
run cargo bench -q "${all[@]}" --bench soak -- 2000
run cargo bench -q "${all[@]}" --bench ucx_read -- 1
run cargo bench -q "${all[@]}" --bench nixl_post -- 1
run cargo bench -q "${all[@]}" --bench discovery_scale -- 80 2
# The README's main job (`cargo run --release -- bench`), on that build's command.
run cargo build -q --release "${all[@]}" --bin kvxfer
run target/release/kvxfer bench --requests 2
# The real-vLLM benchmark, on the environment the test command set up.
if [ -x "$root/.venv-vllm/bin/python" ]; then
    run env KVXFER_VLLM_ENV_READY=1 scripts/bench-vllm.sh --smoke
else
    echo "SKIP scripts/bench-vllm.sh --smoke: no .venv-vllm (scripts/vllm-env.sh sets it up)"
fi
# The real-SGLang benchmark, on the environment the test command set up.
if [ -x "$root/.venv-sglang/bin/python" ]; then
    run env KVXFER_SGLANG_ENV_READY=1 scripts/bench-sglang.sh --smoke
else
    echo "SKIP scripts/bench-sglang.sh --smoke: no .venv-sglang (scripts/sglang-env.sh sets it up)"
fi
echo "benchmark smoke runs: all finished"
