"""Log excerpts of the engine processes a real-engine suite started, for a failing test's
report: CI keeps pytest's report, not the processes' logs. The vLLM and SGLang suites each
keep a list of their live processes and register `report_hook` on it in their conftest."""

import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import pytest

# What a report quotes of each live process's log: kvxfer's lines, warnings and errors.
EXCERPT = re.compile(r"kvxfer|WARNING|ERROR|Traceback|Error|No available shared memory")
EXCERPT_LINES = 60


class Logged(Protocol):
    """A process whose log a report can quote."""

    def log_text(self) -> str: ...


def excerpt(log: str) -> str:
    """The last lines of `log` about kvxfer, warnings and errors."""
    lines = [line for line in log.splitlines() if EXCERPT.search(line)]
    return "\n".join(lines[-EXCERPT_LINES:])


def report_hook(
    live: Sequence[Logged], title: Callable[[Any], str]
) -> Callable[[pytest.Item, pytest.CallInfo[None]], Iterator[None]]:
    """A `pytest_runtest_makereport` hook that adds, to a failing test's report, a section
    per process in `live` (running when the test failed) named by `title`."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
        outcome = yield
        report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
        if report.failed:
            for p in live:
                report.sections.append((title(p), excerpt(p.log_text())))

    return pytest_runtest_makereport
