"""For the benchmark's baseline only: SGLang's own nixl backend on a CPU-only machine.

SGLang labels its KV pool "VRAM" for NIXL even with ``--device cpu``, and NIXL's UCX backend
refuses to register host memory labelled so. On this folder's path (the baseline servers'
``PYTHONPATH`` only), this relabels the memory type "VRAM" as "DRAM" in the ``nixl_agent``
calls that take one, on both sides: what the memory really is. SGLang's code and what it sends
are untouched.
"""

import functools
import importlib
from collections.abc import Callable
from typing import Any

CALLS = ("register_memory", "get_reg_descs", "get_xfer_descs", "prep_xfer_dlist")


def _as_dram(call: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(call)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        args = tuple("DRAM" if isinstance(a, str) and a == "VRAM" else a for a in args)
        if kwargs.get("mem_type") == "VRAM":
            kwargs["mem_type"] = "DRAM"
        return call(self, *args, **kwargs)

    return wrapped


def _relabel() -> None:
    try:
        api = importlib.import_module("nixl._api")
    except ImportError:
        return
    for name in CALLS:
        setattr(api.nixl_agent, name, _as_dram(getattr(api.nixl_agent, name)))


_relabel()
