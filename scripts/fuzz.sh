#!/usr/bin/env bash
# Builds the libFuzzer targets in fuzz/ with coverage instrumentation on the stable toolchain
# (the flags `cargo fuzz` passes, without its nightly-only sanitizer) and runs each for
# SECONDS (default 10). Fails on any crash, panic, leak of the RSS limit or timeout.
# Usage: scripts/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${1:-10}
shift || true
target=x86_64-unknown-linux-gnu
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing"
# Build scripts must not be instrumented: an explicit --target keeps RUSTFLAGS off them.
cargo build -q --release --target "$target"
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(handshake push_messages notifications ucx_metadata nixl_metadata transfer_params
        side_channel_auth listener_request push_decode_room push_prefill_room pull_holds pull_loads
        pull_phases pull_stamps vllm_handshake digest_scratch sglang_nixl_frames)
fi
for t in "${targets[@]}"; do
    corpus="corpus/$t"
    mkdir -p "$corpus" artifacts
    log=$(mktemp)
    if ! "target/$target/release/$t" "$corpus" -max_total_time="$secs" -rss_limit_mb=512 \
        -max_len=4096 -timeout=5 -artifact_prefix=artifacts/ >"$log" 2>&1; then
        tail -40 "$log"
        echo "fuzz target $t failed (input saved under fuzz/artifacts/)" >&2
        exit 1
    fi
    echo "$t: $(grep -E '^#[0-9]+\s+DONE' "$log" | tail -1)"
    rm -f "$log"
done
