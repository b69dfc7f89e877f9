"""The exceptions of agl-algos; each message names the field, the offending value and the fix."""

from __future__ import annotations

__all__ = (
    "AlgosError",
    "MissingFieldError",
    "RemaxNotSupportedError",
    "RolloutConsistencyError",
)


class AlgosError(Exception):
    """Base class of every error agl-algos raises on purpose."""


class RolloutConsistencyError(AlgosError, ValueError):
    """Rows of one rollout disagree (GRPO group, reward sum, or per-token advantage)."""


class MissingFieldError(AlgosError, ValueError):
    """A batch lacks a tensor or non-tensor field an algorithm needs."""


class RemaxNotSupportedError(AlgosError, NotImplementedError):
    """REMAX needs a greedy baseline rollout per sample, which agentic rollouts do not produce."""
