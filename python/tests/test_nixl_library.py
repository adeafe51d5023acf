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


def _nixl_wheel_libs() -> Path:
    found = sorted(ROOT.glob(".venv-nixl/lib/python3*/site-packages/.nixl_cu12.mesonpy.libs"))
    if not found:
        pytest.skip("no NIXL wheel in .venv-nixl: run scripts/nixl-venv.sh")
    return found[0]


def _child(code: str, env: dict[str, str]) -> list[str]:
    """Runs `code` in a fresh interpreter (a runtime loads once per process); its stdout."""
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def _bare_env() -> dict[str, str]:
    drop = ("LD_LIBRARY_PATH", "NIXL_PLUGIN_DIR", nixl.ENV)
    return {k: v for k, v in os.environ.items() if k not in drop}


def test_select_makes_a_wheel_off_the_loader_path_usable_after_a_refusal() -> None:
    libs = _nixl_wheel_libs()
    # The NIXL wheel importable (as in an engine's environment), its library off the
    # loader's path: refused until select() loads it, then usable in the same process.
    code = (
        "import sys, kvxfer, kvxfer.nixl\n"
        f"sys.path.insert(0, {str(libs.parent)!r})\n"
        "try:\n"
        "    kvxfer.Agent('a', 'nixl')\n"
        "except kvxfer.NotAvailableError:\n"
        "    print('not available before')\n"
        "print(kvxfer.nixl.select()[1])\n"
        "kvxfer.Agent('b', 'nixl').shutdown()\n"
        "import os; print(os.environ['NIXL_PLUGIN_DIR'])\n"
    )
    assert _child(code, _bare_env()) == [
        "not available before",
        "the nixl_cu12 wheel",
        str(libs / "plugins"),
    ]


def test_the_variable_alone_opens_its_runtime_in_rust_too() -> None:
    """KVXFER_NIXL_LIBRARY is read by the transport itself (the CLI, a Rust program), not
    only by kvxfer.nixl; a file that is no runtime is refused naming it. (UCX_MODULES as
    kvxfer.nixl.select() and the CLI set it: the wheel's UCX without InfiniBand modules.)"""
    libs = _nixl_wheel_libs()
    code = "import kvxfer\nkvxfer.Agent('a', 'nixl').shutdown()\nprint('available')\n"
    env = {**_bare_env(), nixl.ENV: str(libs / nixl.CAPI), "UCX_MODULES": "^ib*"}
    assert _child(code, env) == ["available"]
    code = (
        "import kvxfer\n"
        "try:\n"
        "    kvxfer.Agent('a', 'nixl')\n"
        "except kvxfer.NotAvailableError as e:\n"
        "    print('/nonexistent/libnixl_capi.so cannot be loaded' in str(e))\n"
    )
    assert _child(code, {**_bare_env(), nixl.ENV: "/nonexistent/libnixl_capi.so"}) == ["True"]
