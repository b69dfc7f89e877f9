"""A pytest plugin every pass of the test command loads: each test runs once per test command.

``scripts/test`` runs each package's tests in a venv of its own first (``.ci/package``), then the
workspace pass. With ``$AGL_PASSED_RECORD`` set (``scripts/test`` sets it), a pass deselects the
tests recorded there as passed by an earlier pass, and records the ones it passes. The workspace
pass so runs what no package pass could (``tests/``, agl-trainer's ``slow`` tests, and every
test that skipped where its package was installed without an extra), and no test runs twice.
Without the variable (``uv run pytest``, ``.ci/package`` alone) every selected test runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_RECORD = "AGL_PASSED_RECORD"


def _record_path() -> Path | None:
    path = os.environ.get(_RECORD)
    return Path(path) if path else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    record = _record_path()
    if record is None or not record.exists():
        return
    passed = set(record.read_text().splitlines())
    ran_before = [item for item in items if item.nodeid in passed]
    if not ran_before:
        return
    items[:] = [item for item in items if item.nodeid not in passed]
    config.hook.pytest_deselected(items=ran_before)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            f"deselected {len(ran_before)} test(s) that passed in an earlier pass (${_RECORD})"
        )


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    record = _record_path()
    if record is not None and report.when == "call" and report.passed:
        with record.open("a") as out:
            out.write(report.nodeid + "\n")
