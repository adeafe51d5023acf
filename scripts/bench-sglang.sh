#!/usr/bin/env bash
# kvxfer's SGLang backend against SGLang's own nixl backend on a real SGLang 0.5.23, side by
# side in one run: python/tests_sglang/bench_sglang.py (its docstring says what is measured).
# The default shape is Llama-3-8B's KV geometry (a seeded model written locally), bf16,
# 2048-token prompts, 5 requests per backend after a warm-up: about 20 min on 2 cores, most of
# it the CPU prefill's compute. --smoke: the tiny model, 2 × 128 tokens, the nixl baseline only.
# Usage: scripts/bench-sglang.sh [--smoke] [--out JSON] [bench_sglang.py options]
# Sets up .venv-sglang first (scripts/sglang-env.sh) unless KVXFER_SGLANG_ENV_READY=1; needs
# the NIXL environment (scripts/nixl-venv.sh) for kvxfer over NIXL.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py="$root/.venv-sglang/bin/python"
[ "${KVXFER_SGLANG_ENV_READY:-}" = 1 ] || py=$("$root/scripts/sglang-env.sh")
eval "$("$root/scripts/nixl-venv.sh")"
cd "$root/python/tests_sglang"
exec "$py" bench_sglang.py "$@"
