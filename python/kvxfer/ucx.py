"""Which UCX library the ``ucx`` transport opens.

kvxfer opens ``libucp`` at run time, once per process: the file ``KVXFER_UCX_LIBRARY`` names,
else the system's ``libucp.so.0``. The UCX version matters for same-host transfers: Debian's
UCX 1.13 serves a READ between two processes by emulation over TCP loopback, while the UCX
that NIXL's wheels bundle (1.23 in nixl 1.5.1) reads the peer's memory directly (CMA), about
eight times faster on our machines. :func:`select` picks one before the first agent exists.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

ENV = "KVXFER_UCX_LIBRARY"
"""The variable the Rust transport reads."""

NIXL_PACKAGES = ("nixl_cu13", "nixl_cu12")
"""The NIXL wheels whose bundled UCX :func:`bundled_library` looks for, preferred first."""


def _is_libucp(name: str) -> bool:
    # libucp.so.0 (a system's) or libucp-<hash>.so.0.0.0 (a wheel's, renamed by auditwheel)
    return name.startswith(("libucp.", "libucp-")) and ".so" in name


def _loaded_libucp(maps: Path = Path("/proc/self/maps")) -> str | None:
    """A ``libucp`` this process has mapped already (NIXL loaded it): using that one keeps a
    single UCX in the process."""
    try:
        text = maps.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset device inode [path]
        if len(fields) == 6 and _is_libucp(Path(fields[5]).name):
            return fields[5]
    return None


def _wheel_libucp(package: str) -> str | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = Path(next(iter(spec.submodule_search_locations))).parent / f"{package}.libs"
    found = sorted(p for p in libs.glob("libucp*") if _is_libucp(p.name))
    return str(found[0]) if found else None


def bundled_library() -> str | None:
    """The ``libucp`` to prefer over the system's: one already mapped into this process,
    else the one a NIXL wheel installed for this interpreter bundles; ``None`` if neither."""
    loaded = _loaded_libucp()
    if loaded is not None:
        return loaded
    for package in NIXL_PACKAGES:
        found = _wheel_libucp(package)
        if found is not None:
            return found
    return None


def skip_ib_modules() -> None:
    """Sets ``UCX_MODULES`` to skip InfiniBand where this machine has no RDMA device."""
    # A bundled UCX loads its own InfiniBand modules; on a machine without RDMA devices they
    # are useless, and next to the system's rdma-core they crash the process at exit.
    ib = Path("/sys/class/infiniband")
    if "UCX_MODULES" not in os.environ and not (ib.is_dir() and any(ib.iterdir())):
        os.environ["UCX_MODULES"] = "^ib*"


def select(setting: str = "auto") -> str | None:
    """Decides which ``libucp`` this process's ``ucx`` agents use, by setting
    ``KVXFER_UCX_LIBRARY``; returns the path chosen (``None``: the system's).

    ``setting``: ``auto`` keeps ``KVXFER_UCX_LIBRARY`` when it is set, else uses
    :func:`bundled_library` when there is one; ``system`` the system's ``libucp.so.0``;
    ``nixl`` a NIXL wheel's (an error when none is installed); anything else is a path.
    It takes effect only before the process's first UCX agent (or ``ucx_version()`` call).
    """
    if setting == "auto":
        if os.environ.get(ENV):
            return os.environ[ENV]
        chosen = bundled_library()
    elif setting == "system":
        os.environ.pop(ENV, None)
        return None
    elif setting == "nixl":
        chosen = bundled_library()
        if chosen is None:
            raise ValueError(
                f"ucx_library=nixl: no NIXL wheel ({', '.join(NIXL_PACKAGES)}) with a bundled "
                "libucp is installed for this interpreter"
            )
    else:
        if not Path(setting).is_file():
            raise ValueError(f"ucx_library={setting!r}: no such file")
        chosen = setting
    if chosen is not None:
        os.environ[ENV] = chosen
        skip_ib_modules()
    return chosen
