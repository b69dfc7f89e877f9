"""The staleness gate: which complete groups are too old to train on.

A group's age at a step is how many weight versions its oldest model call is behind the weights
being trained (``trained_version - oldest call's version``). With a bound ``max_staleness=K`` a
group older than K is not trained: it is dropped (its sample is skipped) or requeued (its sample
runs again as a fresh group), and counted either way. K=0 is on-policy training. verl's V1
trainer calls the same bound ``max_off_policy_threshold``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from agl_rollout.async_manager import CarriedGroup

StaleStrategy = Literal["drop", "requeue"]
STALE_STRATEGIES: tuple[str, ...] = get_args(StaleStrategy)


def group_age(group: CarriedGroup, trained_version: int) -> int | None:
    """Versions between the group's oldest call and ``trained_version``; ``None`` when unknown."""
    span = group.version_span()
    return None if span is None else trained_version - span[0]


@dataclass(frozen=True)
class StalenessGate:
    """``max_staleness``: the bound K in versions (``None``: no bound); ``strategy``: what an over-age group gets."""

    max_staleness: int | None
    strategy: StaleStrategy = "drop"

    def __post_init__(self) -> None:
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None (no bound), got {self.max_staleness}")
        if self.strategy not in STALE_STRATEGIES:
            raise ValueError(
                f"Unsupported stale strategy: {self.strategy!r}. Supported: {list(STALE_STRATEGIES)}"
            )

    def is_stale(self, group: CarriedGroup, trained_version: int) -> bool:
        """Whether ``group`` is more than ``max_staleness`` versions behind ``trained_version``.

        A group whose calls carry no version (a gateway that records none) is never stale.
        """
        if self.max_staleness is None:
            return False
        age = group_age(group, trained_version)
        return age is not None and age > self.max_staleness

    def split(
        self, groups: Sequence[CarriedGroup], trained_version: int
    ) -> tuple[list[CarriedGroup], list[CarriedGroup]]:
        """``groups`` as (fresh, stale), each in the given order."""
        fresh = [g for g in groups if not self.is_stale(g, trained_version)]
        stale = [g for g in groups if self.is_stale(g, trained_version)]
        return fresh, stale


__all__ = ("STALE_STRATEGIES", "StaleStrategy", "StalenessGate", "group_age")
