"""The run-once record across the passes of the test command, each pass a pytest of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent

_SOURCE = """
import os
import pytest

def test_passes() -> None:
    pass

@pytest.mark.skipif(os.environ.get("EXTRA") != "1", reason="the extra is not installed")
def test_needs_the_extra() -> None:
    pass
"""


def _pytest(tmp_path: Path, record: Path | None, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_twice.py").write_text(_SOURCE)
    clean = {k: v for k, v in os.environ.items() if k != "AGL_PASSED_RECORD"}
    if record is not None:
        clean["AGL_PASSED_RECORD"] = str(record)
    plugins = ["-p", "agl_testing.run_once", "-p", "no:randomly", "-p", "no:cacheprovider"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", str(tmp_path), *plugins, "-v", "--rootdir", str(tmp_path)],
        env={**clean, "PYTHONPATH": str(TESTS_DIR), **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_later_pass_runs_only_what_no_earlier_pass_passed(tmp_path: Path) -> None:
    record = tmp_path / "passed.txt"
    package_pass = _pytest(tmp_path, record)
    assert package_pass.returncode == 0, package_pass.stdout
    assert record.read_text() == "test_twice.py::test_passes\n"

    workspace_pass = _pytest(tmp_path, record, EXTRA="1")
    assert workspace_pass.returncode == 0, workspace_pass.stdout
    assert "deselected 1 test(s) that passed in an earlier pass ($AGL_PASSED_RECORD)" in workspace_pass.stdout
    assert "test_twice.py::test_needs_the_extra PASSED" in workspace_pass.stdout
    assert "test_twice.py::test_passes" not in workspace_pass.stdout
    assert record.read_text().splitlines() == [
        "test_twice.py::test_passes",
        "test_twice.py::test_needs_the_extra",
    ]


def test_without_the_record_every_test_runs(tmp_path: Path) -> None:
    run = _pytest(tmp_path, None, EXTRA="1")
    assert run.returncode == 0, run.stdout
    assert "2 passed" in run.stdout
