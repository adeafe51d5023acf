"""Where vLLM runs, a NIXL wheel is installed (vLLM's NixlConnector needs it), and the UCX it
bundles reads a same-host peer's memory directly (CMA). KvxferConnector's default
(``ucx_library=auto``) uses that UCX: a same-host READ then takes UCX's zero-copy CMA path,
not the emulation over TCP loopback that the system's UCX 1.13 uses (a seventh of the speed).
No engines here: the two processes are plain kvxfer agents, chosen as the connector chooses.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def read_once(setting: str) -> tuple[dict[str, object], list[str]]:
    """Runs same_host_read.py with UCX's protocol tables on; its report and those tables'
    rows for ``ucp_get`` (remote memory read)."""
    env = {k: v for k, v in os.environ.items() if k != "KVXFER_UCX_LIBRARY"}
    r = subprocess.run(
        [sys.executable, str(HERE / "same_host_read.py"), setting],
        env={**env, "UCX_PROTO_INFO": "y"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = (r.stdout + r.stderr).splitlines()
    report = json.loads(next(x for x in reversed(out) if x.startswith("{")))
    rows, in_table = [], False
    for line in out:
        if "remote memory read by ucp_get" in line:
            in_table = True
        elif in_table and ("dst " in line or "src " in line):
            in_table = False  # the next table's title
        elif in_table and "|" in line and "Range" not in line:
            rows.append(line)
    return report, rows


def test_auto_uses_nixls_ucx_and_reads_same_host_memory_by_cma() -> None:
    report, rows = read_once("auto")
    assert report["ok"] is True
    library = str(report["library"])
    assert "nixl" in library and Path(library).name.startswith("libucp"), report
    major, minor, _ = (int(x) for x in str(report["version"]).split("."))
    assert (major, minor) >= (1, 19), report
    assert rows, "UCX printed no protocol table for ucp_get"
    assert any("cma" in row and "zero-copy" in row for row in rows), "\n".join(rows)
    assert not any("software emulation" in row for row in rows), "\n".join(rows)


def test_system_setting_keeps_the_system_ucx() -> None:
    report, _ = read_once("system")
    assert report["ok"] is True
    assert report["library"] is None
