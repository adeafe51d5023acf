#!/usr/bin/env bash
# Builds the kvxfer wheel from this checkout into target/wheels and prints its path. One wheel
# serves every venv (abi3: CPython 3.10 and later), so the set-up builds it once. Built as on
# an operator's machine: with UCX's pkg-config file and libclang out of reach (the UCP
# bindings are committed, NIXL's C API is declared in kvxfer, both libraries are opened at
# run time), and always with the same environment, so
# cargo's build of one call is reused by the next instead of rebuilt for a changed variable.
# Needs .venv-py's maturin (scripts/python-venv.sh installs it, then calls this).
# --into PY: installs the wheel into PY's environment instead: the one in KVXFER_WHEEL (the test
# command's set-up builds one for every venv), none with KVXFER_WHEEL=none (installed by a later
# run), else one built from this checkout (through scripts/python-venv.sh).
# Usage: scripts/wheel.sh   (prints the wheel's path) | scripts/wheel.sh --into PY
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out="$root/target/wheels"
if [ "${1:-}" = --into ]; then
    py=${2:?usage: scripts/wheel.sh --into PY}
    case "${KVXFER_WHEEL:-}" in
        none) exit 0 ;;
        "")
            echo "== kvxfer wheel from this checkout" >&2
            "$root/scripts/python-venv.sh" >/dev/null
            wheel=$(ls "$out"/kvxfer-*.whl)
            ;;
        *) wheel=$KVXFER_WHEEL ;;
    esac
    PIP_DISABLE_PIP_VERSION_CHECK=1 "$py" -m pip install -q --no-deps --force-reinstall "$wheel" >&2
    exit 0
fi
rm -rf "$out"
(cd "$root/python" && PATH="$root/.venv-py/bin:$PATH" CARGO_TARGET_DIR="$root/target" \
    PKG_CONFIG_LIBDIR=/nonexistent PKG_CONFIG_PATH= LIBCLANG_PATH=/nonexistent \
    maturin build --release -q -o "$out" >&2)
ls "$out"/kvxfer-*.whl
