"""Finding the NIXL runtime: kvxfer.nixl.find and select, KVXFER_NIXL_LIBRARY.

A runtime is loaded once per process, so what loads one runs in a child interpreter."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvxfer.nixl as nixl

ROOT = Path(__file__).resolve().parents[2]


def fake_wheel(site: Path, package: str) -> Path:
    """A NIXL wheel as meson-python lays one out: the package, and its libraries in a
    hidden sibling folder."""
    (site / package).mkdir()
    (site / package / "__init__.py").write_text("")
    libs = site / f".{package}.mesonpy.libs"
    libs.mkdir()
    (libs / nixl.CAPI).write_bytes(b"")
    return libs / nixl.CAPI


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv(nixl.ENV, raising=False)
    monkeypatch.setattr(sys, "path", [str(tmp_path)])  # only the fake wheels are importable
    importlib.invalidate_caches()
    return tmp_path


def test_the_engines_wheel_is_found_cu13_first(site: Path) -> None:
    cu12 = fake_wheel(site, "nixl_cu12")
    assert nixl.find() == (str(cu12), "the nixl_cu12 wheel")
    cu13 = fake_wheel(site, "nixl_cu13")
    importlib.invalidate_caches()
    assert nixl.find() == (str(cu13), "the nixl_cu13 wheel")


def test_the_variable_wins_and_without_either_the_system_loader_decides(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert nixl.find() == (None, "system")
    fake_wheel(site, "nixl_cu13")
    monkeypatch.setenv(nixl.ENV, "/opt/nixl/libnixl_capi.so")
    assert nixl.find() == ("/opt/nixl/libnixl_capi.so", nixl.ENV)


def test_select_makes_a_runtime_off_the_loader_path_usable() -> None:
    found = sorted(ROOT.glob(".venv-nixl/lib/python3*/site-packages/.nixl_cu12.mesonpy.libs"))
    if not found:
        pytest.skip("no NIXL wheel in .venv-nixl: run scripts/nixl-venv.sh")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "NIXL_PLUGIN_DIR")}
    env[nixl.ENV] = str(found[0] / nixl.CAPI)
    code = (
        "import kvxfer, kvxfer.nixl\n"
        "try:\n"
        "    kvxfer.Agent('a', 'nixl')\n"
        "except kvxfer.NotAvailableError:\n"
        "    print('not available before')\n"
        "print(kvxfer.nixl.select()[1])\n"
        "kvxfer.Agent('b', 'nixl').shutdown()\n"
        "import os; print(os.environ['NIXL_PLUGIN_DIR'])\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "not available before",
        nixl.ENV,
        str(found[0] / "plugins"),
    ]


def test_a_missing_file_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(nixl.ENV, "/nonexistent/libnixl_capi.so")
    monkeypatch.setattr(nixl, "_loaded", None)
    with pytest.raises(ValueError, match="no such file '/nonexistent/libnixl_capi.so'"):
        nixl.select()
