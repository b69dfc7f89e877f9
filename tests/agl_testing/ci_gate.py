"""A pytest plugin every pass of the test command loads (through the root ``conftest.py``).

- selects the Hypothesis profile: ``ci`` under ``CI=true`` (derandomized, so a run replays
  exactly; no example database), ``dev`` elsewhere (random exploration, failures saved to
  the local database); both print the blob that replays a failure (``@reproduce_failure``);
  ``HYPOTHESIS_PROFILE`` overrides the choice;
- counts the pass's skips, prints them with the shuffle seed (pytest-randomly) so an
  order-dependent failure can be replayed, appends that line to ``$AGL_SKIP_REPORT`` when set
  (``scripts/test`` prints them all at the end), and under ``CI=true`` fails the session on
  any skip whose reason is not allowed in this pass (``agl_testing.requirements.ALLOWED_SKIPS``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from agl_testing.requirements import current_pass, is_allowed_skip, under_ci

# A loaded 2-core CI machine makes any per-example deadline a flake, not a finding.
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    print_blob=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", print_blob=True, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if under_ci() else "dev"))


def _skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):
        return str(longrepr[2])
    return str(longrepr)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    skipped = [r for r in reporter.stats.get("skipped", []) if not hasattr(r, "wasxfail")]
    unexpected = sorted({_skip_reason(r) for r in skipped if not is_allowed_skip(_skip_reason(r))})
    seed = session.config.getoption("randomly_seed", default=None)
    order = f"shuffled, replay with --randomly-seed={seed}" if seed is not None else "file order"
    line = f"pass {current_pass()}: {len(skipped)} skipped, {len(unexpected)} not allowed ({order})"
    reporter.line("")
    reporter.write_sep("-", line)
    if report_path := os.environ.get("AGL_SKIP_REPORT"):
        with Path(report_path).open("a") as out:
            out.write(line + "\n")
    if under_ci() and unexpected:
        for reason in unexpected:
            reporter.write_line(f"skip not allowed under CI=true in pass {current_pass()}: {reason}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
