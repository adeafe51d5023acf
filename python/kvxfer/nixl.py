"""Which NIXL runtime the ``nixl`` transport opens.

kvxfer's NIXL transport opens ``libnixl_capi.so`` by name at run time. Inside an engine's
environment the runtime is usually the NIXL wheel the engine itself installed (vLLM installs
``nixl-cu13``), whose libraries are not on the loader's search path. :func:`select` finds
one and loads it before kvxfer's first NIXL agent, so that opening ``libnixl_capi.so`` by
name finds the one already loaded, and points ``NIXL_PLUGIN_DIR`` at its plugins.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

from kvxfer.ucx import skip_ib_modules

ENV = "KVXFER_NIXL_LIBRARY"
"""A ``libnixl_capi.so`` to use in place of any other."""

PACKAGES = ("nixl_cu13", "nixl_cu12")
"""The NIXL wheels :func:`wheel_library` looks in, preferred first."""

CAPI = "libnixl_capi.so"

_loaded: str | None = None


def wheel_library(package: str) -> str | None:
    """The ``libnixl_capi.so`` the NIXL wheel ``package`` installed for this interpreter."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    site = Path(next(iter(spec.submodule_search_locations))).parent
    for libs in (f".{package}.mesonpy.libs", f"{package}.libs"):
        if (site / libs / CAPI).is_file():
            return str(site / libs / CAPI)
    return None


def find() -> tuple[str | None, str]:
    """The runtime to use and where it came from: ``KVXFER_NIXL_LIBRARY``, else a NIXL wheel
    of this interpreter, else ``(None, "system")`` (the loader's search path)."""
    if os.environ.get(ENV):
        return os.environ[ENV], ENV
    for package in PACKAGES:
        found = wheel_library(package)
        if found is not None:
            return found, f"the {package} wheel"
    return None, "system"


def select() -> tuple[str | None, str]:
    """Loads the runtime :func:`find` picks (once a process) and sets ``NIXL_PLUGIN_DIR`` to
    its plugins unless set; returns what :func:`find` returned. Call it before the first
    ``nixl`` agent: one that already opened a runtime keeps it. The UCX a wheel bundles
    skips InfiniBand modules on a machine without RDMA devices (see :mod:`kvxfer.ucx`)."""
    global _loaded
    path, source = find()
    if path is None or _loaded is not None:
        return (_loaded or path), source
    if not Path(path).is_file():
        raise ValueError(f"{source}: no such file {path!r}")
    # Loaded globally under its soname: the transport's dlopen("libnixl_capi.so") gets it.
    skip_ib_modules()
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    _loaded = path
    plugins = Path(path).parent / "plugins"
    if "NIXL_PLUGIN_DIR" not in os.environ and plugins.is_dir():
        os.environ["NIXL_PLUGIN_DIR"] = str(plugins)
    return path, source
