#!/usr/bin/env bash
# Builds the kvxfer wheel from this checkout into target/wheels and prints its path. One wheel
# serves every venv (abi3: CPython 3.10 and later), so the set-up builds it once. Built as on
# an operator's machine: with UCX's pkg-config file out of reach (its UCP bindings are
# committed, the library is opened at run time), and always with the same environment, so
# cargo's build of one call is reused by the next instead of rebuilt for a changed variable.
# Needs .venv-py's maturin (scripts/python-venv.sh installs it, then calls this).
# Usage: scripts/wheel.sh   (prints the wheel's path)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out="$root/target/wheels"
rm -rf "$out"
(cd "$root/python" && PATH="$root/.venv-py/bin:$PATH" CARGO_TARGET_DIR="$root/target" \
    PKG_CONFIG_LIBDIR=/nonexistent PKG_CONFIG_PATH= \
    maturin build --release -q -o "$out" >&2)
ls "$out"/kvxfer-*.whl
