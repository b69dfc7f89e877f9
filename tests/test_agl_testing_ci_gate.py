"""The CI gate on skips and the Hypothesis profiles, run in a pytest of their own (a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agl_testing.requirements import ALLOWED_SKIPS, TOKEN_SUM_REASON, is_allowed_skip

TESTS_DIR = Path(__file__).resolve().parent

_SKIPPING = """
import pytest
from agl_testing.requirements import import_optional, skip_unless, TOKEN_SUM_REASON

def test_runs() -> None:
    pass

@skip_unless(False, TOKEN_SUM_REASON)
def test_old_verl() -> None:
    pass

def test_optional() -> None:
    import_optional("agl_no_such_module")
"""

_PROFILE = """
from hypothesis import settings

def test_profile() -> None:
    current = settings.default
    print(f"PROFILE derandomize={current.derandomize} database={current.database} blob={current.print_blob}")
"""


def _pytest(tmp_path: Path, source: str, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_gated.py").write_text(source)
    clean = {k: v for k, v in os.environ.items() if k not in {"CI", "AGL_TEST_PASS", "HYPOTHESIS_PROFILE"}}
    report = tmp_path / "skips.txt"
    plugins = ["-p", "agl_testing.ci_gate", "-p", "no:randomly", "-p", "no:cacheprovider"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", str(tmp_path), *plugins, "-s", "-q", "--rootdir", str(tmp_path)],
        env={**clean, "PYTHONPATH": str(TESTS_DIR), "AGL_SKIP_REPORT": str(report), **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_skips_are_counted_and_pass_outside_ci(tmp_path: Path) -> None:
    run = _pytest(tmp_path, _SKIPPING)
    assert run.returncode == 0, run.stdout
    line = "pass workspace: 2 skipped, 2 not allowed (file order)"
    assert line in run.stdout
    assert (tmp_path / "skips.txt").read_text() == line + "\n"


def test_a_skip_not_on_the_allow_list_fails_the_run_under_ci(tmp_path: Path) -> None:
    run = _pytest(tmp_path, _SKIPPING, CI="true", AGL_TEST_PASS="verl-compat")
    assert run.returncode == pytest.ExitCode.TESTS_FAILED, run.stdout
    assert "pass verl-compat: 2 skipped, 1 not allowed (file order)" in run.stdout
    assert (
        "skip not allowed under CI=true in pass verl-compat: Skipped: agl_no_such_module is not "
        "installed (an optional extra of the package under test)"
    ) in run.stdout


def test_skips_allowed_in_their_pass_keep_the_ci_run_green(tmp_path: Path) -> None:
    source = _SKIPPING.replace('import_optional("agl_no_such_module")', "pass")
    run = _pytest(tmp_path, source, CI="true", AGL_TEST_PASS="verl-compat")
    assert run.returncode == 0, run.stdout
    assert "pass verl-compat: 1 skipped, 0 not allowed (file order)" in run.stdout
    workspace = _pytest(tmp_path, source, CI="true")
    assert workspace.returncode == pytest.ExitCode.TESTS_FAILED, workspace.stdout


def test_the_allow_list_admits_each_reason_only_in_its_passes() -> None:
    assert is_allowed_skip(f"Skipped: {TOKEN_SUM_REASON}", "verl-compat")
    assert not is_allowed_skip(TOKEN_SUM_REASON, "workspace")
    assert not any("workspace" in allowed.passes for allowed in ALLOWED_SKIPS)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"CI": "true"}, "PROFILE derandomize=True database=None blob=True"),
        ({}, "PROFILE derandomize=False database=DirectoryBasedExampleDatabase"),
    ],
)
def test_ci_selects_the_reproducible_hypothesis_profile(
    tmp_path: Path, env: dict[str, str], expected: str
) -> None:
    run = _pytest(tmp_path, _PROFILE, **env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert expected in run.stdout


def test_no_test_module_skips_on_a_missing_package_outside_agl_testing_requirements() -> None:
    """``pytest.importorskip`` of a whole package skips quietly on a broken install; the one way to
    skip for something missing is :mod:`agl_testing.requirements` (the CI gate knows its reasons)."""
    repo = TESTS_DIR.parent
    test_files = [*repo.glob("packages/*/tests/**/*.py"), *TESTS_DIR.glob("**/*.py")]
    offenders = sorted(
        str(path.relative_to(repo))
        for path in test_files
        if path.name not in {"requirements.py", Path(__file__).name}
        and "importorskip(" in path.read_text(encoding="utf-8")
    )
    assert offenders == []
