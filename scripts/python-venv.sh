#!/usr/bin/env bash
# Creates .venv-py with the Python toolchain for the bindings (maturin, pytest, ruff, numpy)
# and installs the kvxfer package from this checkout into it (the wheel scripts/wheel.sh
# builds, with the UCX and NIXL transports). Idempotent: tools are installed once, the
# package is rebuilt each time (cargo's build makes an unchanged tree quick).
# --tools: the toolchain only, no wheel.
# Usage: scripts/python-venv.sh [--tools]   (prints the venv's python)
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
if [ "${1:-}" != --tools ]; then
    wheel=$("$root/scripts/wheel.sh")
    "$venv/bin/pip" install -q --force-reinstall --no-deps "$wheel" >&2
fi
echo "$venv/bin/python"
