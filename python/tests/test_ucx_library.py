"""Choosing the UCX library: kvxfer.ucx.select and KVXFER_UCX_LIBRARY.

The library is loaded once per process, so what loads one runs in a child interpreter.
"""

import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvxfer
import kvxfer.ucx as ucx


def child(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Runs `code` in a fresh interpreter with `env` added; its output is returned."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def fake_nixl_wheel(site: Path, package: str, files: list[str]) -> None:
    """A package `package` with a sibling `<package>.libs` holding `files`, as auditwheel
    lays out a NIXL wheel."""
    (site / package).mkdir()
    (site / package / "__init__.py").write_text("")
    (site / f"{package}.libs").mkdir()
    for f in files:
        (site / f"{package}.libs" / f).write_bytes(b"")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(ucx.ENV, raising=False)
    monkeypatch.delenv("UCX_MODULES", raising=False)
    return monkeypatch


def test_a_library_that_cannot_be_loaded_is_named_in_the_error() -> None:
    missing = "/nonexistent/libucp.so.0"
    r = child(
        "import kvxfer\n"
        "for f in (kvxfer.ucx_version, lambda: kvxfer.Agent('a', 'ucx')):\n"
        "    try:\n"
        "        f()\n"
        "    except kvxfer.NotAvailableError as e:\n"
        "        print('NotAvailable:', e)\n",
        KVXFER_UCX_LIBRARY=missing,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2, r.stdout
    for line in lines:
        assert line.startswith("NotAvailable:") and missing in line, line
        assert "KVXFER_UCX_LIBRARY" in line, line


def test_the_system_library_by_default() -> None:
    try:
        version = kvxfer.ucx_version()
    except kvxfer.NotAvailableError as e:
        pytest.skip(f"no UCX here: {e}")
    assert re.fullmatch(r"1\.\d+\.\d+", version), version
    # The library's own answer, asked without kvxfer.
    ucp = ctypes.CDLL("libucp.so.0")
    ucp.ucp_get_version_string.restype = ctypes.c_char_p
    assert version == ucp.ucp_get_version_string().decode()
    for named in ("libucp.so.0", ""):  # empty: as if unset
        r = child("import kvxfer; print(kvxfer.ucx_version())", KVXFER_UCX_LIBRARY=named)
        assert r.stdout.strip() == version, (named, r.stderr)


def test_select_system_and_explicit_paths(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv(ucx.ENV, "/somewhere/libucp.so")
    assert ucx.select("system") is None
    assert ucx.ENV not in os.environ
    with pytest.raises(ValueError, match="no such file"):
        ucx.select(str(tmp_path / "missing.so"))
    lib = tmp_path / "libucp.so.0"
    lib.write_bytes(b"")
    assert ucx.select(str(lib)) == str(lib)
    assert os.environ[ucx.ENV] == str(lib)


def test_auto_keeps_what_the_environment_says(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(ucx.ENV, "/chosen/by/operator/libucp.so.0")
    clean_env.setattr(ucx, "bundled_library", lambda: "/bundled/libucp.so")
    assert ucx.select("auto") == "/chosen/by/operator/libucp.so.0"
    assert "UCX_MODULES" not in os.environ


def test_auto_prefers_a_bundled_library_and_skips_ib_modules_without_rdma(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setattr(ucx, "bundled_library", lambda: "/bundled/libucp-abc.so.0.0.0")
    assert ucx.select() == "/bundled/libucp-abc.so.0.0.0"
    assert os.environ[ucx.ENV] == "/bundled/libucp-abc.so.0.0.0"
    ib = Path("/sys/class/infiniband")
    rdma = ib.is_dir() and any(ib.iterdir())
    assert os.environ.get("UCX_MODULES") == (None if rdma else "^ib*")
    clean_env.setenv("UCX_MODULES", "^cuda")
    ucx.select()
    assert os.environ["UCX_MODULES"] == "^cuda"


def test_auto_falls_back_to_the_system_library(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setattr(ucx, "bundled_library", lambda: None)
    assert ucx.select() is None
    assert ucx.ENV not in os.environ
    with pytest.raises(ValueError, match="no NIXL wheel"):
        ucx.select("nixl")


def test_bundled_library_found_in_a_nixl_wheel(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake_nixl_wheel(tmp_path, "fake_nixl_a", ["libucs-1.so.0", "libucp-b39b3ed9.so.0.0.0"])
    fake_nixl_wheel(tmp_path, "fake_nixl_b", ["libucp-ffff.so.0.0.0"])
    fake_nixl_wheel(tmp_path, "fake_nixl_empty", ["libucs-1.so.0", "libucp.a"])
    clean_env.syspath_prepend(str(tmp_path))
    clean_env.setattr(ucx, "_loaded_libucp", lambda: None)
    clean_env.setattr(ucx, "NIXL_PACKAGES", ("absent_pkg", "fake_nixl_empty", "fake_nixl_a"))
    assert ucx.bundled_library() == str(tmp_path / "fake_nixl_a.libs/libucp-b39b3ed9.so.0.0.0")
    clean_env.setattr(ucx, "NIXL_PACKAGES", ("fake_nixl_b", "fake_nixl_a"))
    assert ucx.bundled_library() == str(tmp_path / "fake_nixl_b.libs/libucp-ffff.so.0.0.0")
    clean_env.setattr(ucx, "NIXL_PACKAGES", ("absent_pkg",))
    assert ucx.bundled_library() is None


def test_a_libucp_already_in_the_process_wins(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 11 /usr/lib/libucs.so.0.0.0\n"
        "7f01-7f02 rw-p 00000000 00:00 0 \n"
        "7f02-7f03 r-xp 00000000 08:01 12 /opt/my wheels/nixl.libs/libucp-9a.so.0.0.0\n"
    )
    assert ucx._loaded_libucp(maps) == "/opt/my wheels/nixl.libs/libucp-9a.so.0.0.0"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 11 /usr/lib/libucp.so.0.0.0\n")
    assert ucx._loaded_libucp(maps) == "/usr/lib/libucp.so.0.0.0"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 11 /usr/lib/libucpx.txt\n")
    assert ucx._loaded_libucp(maps) is None
    assert ucx._loaded_libucp(tmp_path / "absent") is None
    clean_env.setattr(ucx, "_loaded_libucp", lambda: "/in/process/libucp.so.0")
    clean_env.setattr(ucx, "_wheel_libucp", lambda package: "/wheel/libucp-1.so")
    assert ucx.bundled_library() == "/in/process/libucp.so.0"
