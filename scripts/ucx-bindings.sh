#!/usr/bin/env bash
# Regenerates transport-ucx/src/ucp_bindings.rs, the committed UCP bindings, from the system
# UCX's headers (Debian's libucx-dev, >= 1.13) with bindgen (needs libclang-dev), so that
# building kvxfer (and its wheel) needs neither. With --check, fails when the committed file
# differs from what the headers give now (as the test the all-features build runs,
# transport-ucx's sys::committed, does).
# Usage: scripts/ucx-bindings.sh [--check]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
committed=transport-ucx/src/ucp_bindings.rs
cargo build -q -p kvxfer-transport-ucx --features regen-bindings --message-format=json \
    >"${TMPDIR:-/tmp}/ucx-bindings.$$.json"
out=$(python3 -c '
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") == "build-script-executed" and "kvxfer-transport-ucx" in m["package_id"]:
        print(m["out_dir"])
' "${TMPDIR:-/tmp}/ucx-bindings.$$.json" | tail -1)
rm -f "${TMPDIR:-/tmp}/ucx-bindings.$$.json"
fresh="$out/ucp_bindings.rs"
[ -f "$fresh" ] || { echo "no bindings generated under $out" >&2; exit 1; }
if [ "${1:-}" = "--check" ]; then
    if ! diff -q "$committed" "$fresh" >/dev/null; then
        diff -u "$committed" "$fresh" | head -40 >&2 || true
        echo "$committed is not what the UCX headers give: run scripts/ucx-bindings.sh" >&2
        exit 1
    fi
    echo "$committed is current"
else
    cp "$fresh" "$committed"
    echo "wrote $committed"
fi
