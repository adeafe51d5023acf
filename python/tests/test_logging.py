"""The core's logs reach stderr from Python: warnings by default, what `KVXFER_LOG` asks
otherwise. Each case runs in a child process, since a process installs its logger once."""

import os
import subprocess
import sys
from pathlib import Path

# A prefill worker on loopback: opening its side channel logs "side channel listening" at
# debug level.
SCRIPT = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_pull import cache, worker
w, _ = worker("prefill", "loopback", "packed-kv", cache("packed-kv", 1))
w.shutdown()
"""


def _stderr(log: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "KVXFER_LOG"}
    if log is not None:
        env["KVXFER_LOG"] = log
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_kvxfer_log_selects_what_reaches_stderr() -> None:
    assert "side channel listening" in _stderr("kvxfer_core=debug")
    assert "side channel listening" not in _stderr("kvxfer_core=info")


def test_without_a_usable_filter_only_warnings_show() -> None:
    assert "side channel listening" not in _stderr(None)
    # A filter that does not parse is not an error: the default holds.
    assert "side channel listening" not in _stderr("kvxfer_core=[")
