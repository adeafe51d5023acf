#!/usr/bin/env bash
# Creates .venv-py with the Python toolchain for the bindings (maturin, pytest, ruff, numpy)
# and installs the kvxfer package from this checkout into it (`pip install ./python`, built
# with the UCX and NIXL transports). Idempotent: tools are installed once, the package is
# rebuilt each time (cargo's incremental build makes an unchanged tree quick).
# Usage: scripts/python-venv.sh   (prints the venv's python)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv-py"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv" >&2
fi
if ! "$venv/bin/python" -c 'import maturin, pytest, numpy' 2>/dev/null ||
    ! [ -x "$venv/bin/ruff" ]; then
    "$venv/bin/pip" install -q 'maturin>=1.9,<2' 'pytest>=8' 'ruff>=0.6' 'numpy>=1.26' >&2
fi
# --no-build-isolation: build with the maturin above instead of fetching one per install.
PATH="$venv/bin:$PATH" CARGO_TARGET_DIR="$root/target" "$venv/bin/pip" install -q --no-build-isolation \
    --force-reinstall --no-deps "$root/python" >&2
echo "$venv/bin/python"
