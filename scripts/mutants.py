"""Mutation sweep over the connectors and the layout math, with the tests of every package.

cargo-mutants (27.1) runs only the mutated package's tests, but the pull and push
connectors are exercised by kvxfer-tests' scenarios and the layout math by kvxfer-core
and kvxfer-tests too. This script takes cargo-mutants' list of mutants and tests each one
in a git worktree of HEAD, in phases from cheap to slow; a mutant is caught at the first
phase that fails, unviable when it does not build, missed when every phase passes, and
unapplied when its diff does not apply to HEAD.
Results append to a JSON-lines file, so a stopped sweep resumes where it stopped.

usage: python3 scripts/mutants.py OUT.jsonl [FILE_PATTERN ...]
       python3 scripts/mutants.py --summary OUT.jsonl
Run from the repository root; default patterns: the files issue #15 names. The worktree
and its target directory live under $TMPDIR (about 3 GB); delete them afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

DEFAULT = [
    "layout/src/plan.rs",
    "layout/src/tp.rs",
    "core/src/pull/**",
    "core/src/push/**",
]


def tests(*names: str) -> list[str]:
    cmd = ["cargo", "test", "-q", "-p", "kvxfer-tests"]
    for n in names:
        cmd += ["--test", n]
    return cmd


CORE = ["cargo", "test", "-q", "-p", "kvxfer-core", "--lib"]
LAYOUT = ["cargo", "test", "-q", "-p", "kvxfer-layout"]
PULL = tests("pull", "pull_prepared", "pull_notes", "pull_restart")
PUSH = tests("push", "push_peers", "push_liveness")
BOTH = tests(
    "pull",
    "pull_prepared",
    "pull_notes",
    "pull_restart",
    "push",
    "push_peers",
    "push_liveness",
)
# The slow end-to-end binaries last, only for mutants the fast scenarios missed.
SLOW = tests("chaos", "facade")
# Each phase builds first (under BUILD_LIMIT_S), then runs its tests under a limit a few
# times their time on an unmutated tree: a mutant that leaves a scenario waiting for its
# 60 s deadline counts as a timeout, as cargo-mutants counts hangs.
BUILD_LIMIT_S = 900
UNIT_LIMIT_S, SCENARIO_LIMIT_S, SLOW_LIMIT_S = 60, 40, 90


def limit(cmd: list[str]) -> int:
    if cmd is SLOW:
        return SLOW_LIMIT_S
    return UNIT_LIMIT_S if cmd in (LAYOUT, CORE) else SCENARIO_LIMIT_S


def phases(path: str) -> list[list[str]]:
    if path.startswith("layout/"):
        return [LAYOUT, CORE, BOTH, SLOW]
    return [CORE, PULL if "/pull/" in path else PUSH, SLOW]


def package(pattern: str) -> str:
    return "kvxfer-layout" if pattern.startswith("layout/") else "kvxfer-core"


def list_mutants(patterns: list[str], wt: Path) -> list[dict]:
    """Lists the mutants of the worktree's own sources, so every diff applies there."""
    mutants: list[dict] = []
    for pkg in sorted({package(p) for p in patterns}):
        cmd = ["cargo", "mutants", "-p", pkg, "--list", "--json", "--diff"]
        for p in patterns:
            if package(p) == pkg:
                cmd += ["-f", p]
        listed = subprocess.run(cmd, cwd=wt, capture_output=True, text=True, check=True)
        mutants += json.loads(listed.stdout)
    return mutants


def run(
    cmd: list[str], cwd: Path, env: dict[str, str], timeout: int
) -> tuple[int | None, str, float]:
    """Runs `cmd` in a session of its own, so that a timeout kills the test binaries cargo
    started, not only cargo."""
    start = time.monotonic()
    with subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as p:
        try:
            out, _ = p.communicate(timeout=timeout)
            return p.returncode, out, time.monotonic() - start
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            return None, "", time.monotonic() - start


def test_one(m: dict, wt: Path, env: dict[str, str]) -> dict:
    result, times, why = "missed", [], []
    patch = subprocess.run(
        ["patch", "-s", "-p0", m["file"]],
        input=m["diff"],
        text=True,
        cwd=wt,
        check=False,
    )
    try:
        if patch.returncode != 0:
            result = "unapplied"
        for cmd in phases(m["file"]) if patch.returncode == 0 else []:
            rc, _, _ = run([*cmd, "--no-run"], wt, env, BUILD_LIMIT_S)
            if rc != 0:
                result = "unviable" if rc is not None else "timeout"
                break
            rc, log, secs = run(cmd, wt, env, limit(cmd))
            times.append(round(secs, 1))
            if rc == 0:
                continue
            result = "timeout" if rc is None else "caught"
            why = [line for line in log.splitlines() if "FAILED" in line][:2]
            break
    finally:
        subprocess.run(["git", "checkout", "-q", "--", "."], cwd=wt, check=True)
    return {
        "name": m["name"],
        "file": m["file"],
        "result": result,
        "phase": len(times),
        "times": times,
        "why": why,
    }


def summary(out: Path) -> None:
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    print(f"{len(rows)} mutants:", dict(Counter(r["result"] for r in rows)))
    by_file: dict[str, Counter] = {}
    for r in rows:
        by_file.setdefault(r["file"], Counter())[r["result"]] += 1
    for f, c in sorted(by_file.items()):
        print(f"  {f}: {dict(c)}")
    for r in rows:
        if r["result"] in ("missed", "timeout"):
            print(f"{r['result'].upper()} {r['name']}")


def main(argv: list[str]) -> None:
    if argv[:1] == ["--summary"]:
        summary(Path(argv[1]))
        return
    out, patterns = Path(argv[0]).resolve(), argv[1:] or DEFAULT
    done = set()
    if out.exists():
        done = {json.loads(line)["name"] for line in out.read_text().splitlines()}
    wt = Path(tempfile.mkdtemp(prefix="kvxfer-mutants-")) / "wt"
    subprocess.run(
        ["git", "worktree", "add", "-q", "--detach", str(wt), "HEAD"], check=True
    )
    env = dict(os.environ, CARGO_TARGET_DIR=str(wt / "target"), RUST_BACKTRACE="0")
    mutants = [m for m in list_mutants(patterns, wt) if m["name"] not in done]
    print(f"{len(mutants)} mutants to test in {wt}", flush=True)
    for m in mutants:
        row = test_one(m, wt, env)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(row["result"], row["phase"], sum(row["times"]), row["name"], flush=True)
    summary(out)
    print(f"remove the worktree: git worktree remove --force {wt}")


if __name__ == "__main__":
    main(sys.argv[1:])
