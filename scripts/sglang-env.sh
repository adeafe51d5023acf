#!/usr/bin/env bash
# The SGLang test environment: .venv-sglang with a real, unmodified SGLang 0.5.23 from PyPI, its
# router (sglang-router 0.3.2), NIXL 1.5.1 (SGLang's own nixl backend, the benchmark's
# baseline), the kvxfer package built from this checkout, pytest, and a tiny Llama with seeded
# random weights written locally (nothing is downloaded from a model hub).
# Idempotent: each part is installed only when missing (the kvxfer wheel is rebuilt each time).
# Usage: scripts/sglang-env.sh   (prints the venv's python)
#
# SGLang 0.5.23 is a cp311 wheel that pins torch==2.14.1 and a set of CUDA-only kernel packages,
# with no CPU extra. PyPI's torch==2.14.1 (a CUDA build) runs on CPU, so torch is installed
# first, then SGLang without dependencies, then its other requirements from its own metadata
# with the torch family and the CUDA-only packages left out. SGLang's CPU engine imports two ops
# from the kernel package that PyPI has no CPU build of; python/tests_sglang/sgl_kernel stands
# in for them when the tests start the servers.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv-sglang"
py="$venv/bin/python"
say() { printf '== sglang-env: %s\n' "$*" >&2; }
if [ ! -x "$py" ]; then
    base=$(command -v python3.11 || true)
    if [ -z "$base" ]; then
        echo "sglang-env: SGLang 0.5.23 needs Python 3.11 (python3.11 not found)" >&2
        exit 2
    fi
    "$base" -m venv "$venv" >&2
fi
pip() { PIP_DISABLE_PIP_VERSION_CHECK=1 "$py" -m pip "$@" >&2; }

if ! "$py" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.14.1")' 2>/dev/null; then
    say "torch 2.14.1 (PyPI)"
    pip install -q torch==2.14.1
fi
# The marker is written only once the requirements are in too.
marker="$venv/.sglang-0.5.23-complete"
if [ ! -f "$marker" ] ||
    ! "$py" -c 'import importlib.metadata as m, sys; sys.exit(m.version("sglang") != "0.5.23")' 2>/dev/null; then
    say "sglang 0.5.23 and its requirements (torch family and CUDA-only kernels excluded)"
    pip install -q packaging
    pip install -q --no-deps sglang==0.5.23
    reqs=$("$py" - <<'PY'
import importlib.metadata as md
from packaging.requirements import Requirement

# The torch family (pinned above) and packages that only run on NVIDIA GPUs.
skip = {
    "torch", "torchaudio", "torchvision", "torchcodec", "timm", "flash-attn-4",
    "flashinfer-python", "humming-kernels", "nvidia-cutlass-dsl", "nvidia-mathdx",
    "nvshmem4py-cu13", "quack-kernels", "sgl-deep-ep", "sgl-deep-gemm", "sgl-flash-mla",
    "sglang-kernel", "tilelang", "torch-memory-saver",
}
for line in md.requires("sglang") or []:
    r = Requirement(line)
    name = r.name.lower().replace("_", "-")
    if name in skip or (r.marker and not r.marker.evaluate({"extra": ""})):
        continue
    r.marker = None
    print(r)
PY
)
    # SGLang imports torchvision at start-up; it comes from the same PyPI build as torch.
    # shellcheck disable=SC2086 # one requirement per line, none with spaces
    pip install -q $(printf '%s\n' "$reqs" | tr '\n' ' ') torchvision torch==2.14.1
    touch "$marker"
fi
if ! "$py" -c 'import importlib.metadata as m, sys; sys.exit(m.version("sglang-router") != "0.3.2")' 2>/dev/null; then
    say "sglang-router 0.3.2"
    pip install -q --no-deps sglang-router==0.3.2
fi
# SGLang's own nixl backend, the benchmark's baseline, imports nixl._api (nixl-cu13 for
# PyPI's torch 2.14.1, a CUDA 13 build).
if ! "$py" -c 'import nixl._api' 2>/dev/null; then
    say "nixl 1.5.1 (for SGLang's nixl backend)"
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
echo "$py"
