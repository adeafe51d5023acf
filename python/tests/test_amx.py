"""Importing kvxfer asks for AMX's tile state before any kvxfer thread exists, so that an
engine's AMX kernels still run in the process (vLLM's bf16 CPU attention died with SIGILL
where a kvxfer worker had started its threads first)."""

import subprocess
import sys
from pathlib import Path

import pytest

CHECK = """
import ctypes
import kvxfer
agent = kvxfer.Agent("amx-probe", "loopback")  # threads of its own
libc = ctypes.CDLL(None, use_errno=True)
mask = ctypes.c_ulong(0)
# arch_prctl(ARCH_GET_XCOMP_PERM): the state components this process may use.
assert libc.syscall(158, 0x1022, ctypes.byref(mask)) == 0
print(bool(mask.value & (1 << 18)))
agent.shutdown()
"""


def amx() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and "amx_tile" in cpuinfo.read_text()


@pytest.mark.skipif(not amx(), reason="no AMX on this CPU")
def test_the_tile_state_is_granted_before_kvxfer_starts_threads() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "True", out
