"""Keeps Intel AMX usable in a process where kvxfer starts threads.

On Linux a process must ask for AMX's tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``) before
using AMX, and the kernel refuses the request once any thread has a signal stack too small for
that state. Rust gives every thread it starts such a stack, sized for the state enabled when
the thread starts. A kvxfer worker that started its threads before the engine's first AMX
kernel (vLLM's CPU attention runs AMX for bf16 caches on Sapphire Rapids and later) made that
kernel die with SIGILL. Asking first, as PyTorch does before its own AMX kernels, avoids it.
"""

import ctypes
import platform
import sys

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def request_tile_state() -> bool:
    """Asks the kernel for AMX's tile state for this process; True when granted (already
    or now). False where there is no AMX or the request is refused: nothing changes then."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.syscall(
            ctypes.c_long(_SYS_ARCH_PRCTL),
            ctypes.c_long(_ARCH_REQ_XCOMP_PERM),
            ctypes.c_long(_XFEATURE_XTILEDATA),
        )
    except (OSError, AttributeError):
        return False
    return rc == 0
