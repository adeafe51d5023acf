#!/usr/bin/env bash
# Creates .venv-nixl in the repository with the NIXL runtime from PyPI (no GPU needed) and
# numpy, for the peer baselines in ../shared/peers and the NIXL transport's tests.
# Usage: scripts/nixl-venv.sh   (idempotent; prints the environment to export)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv-nixl"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c 'import nixl_cu12, numpy' 2>/dev/null; then
    "$venv/bin/pip" install -q --no-deps nixl-cu12==1.5.1 numpy
fi
site=$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
echo "export LD_LIBRARY_PATH=$site/.nixl_cu12.mesonpy.libs:$site/nixl_cu12.libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
echo "export NIXL_PLUGIN_DIR=$site/.nixl_cu12.mesonpy.libs/plugins"
# The wheel bundles its own UCX and rdma-core. On a machine without RDMA devices its IB
# modules are useless, and where the system rdma-core is also installed (libucx0 depends on
# it) one of them loads the system libibverbs: two libnl copies then crash the process at
# exit. Skip those modules there, unless UCX_MODULES is already set.
if [ -z "${UCX_MODULES:-}" ] && [ -z "$(ls -A /sys/class/infiniband 2>/dev/null)" ]; then
    echo "export UCX_MODULES='^ib*'"
fi
