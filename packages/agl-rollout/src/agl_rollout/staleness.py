"""The staleness gate (which complete groups are too old to train on) and the admission rule.

A group's age at a step is how many weight versions its oldest model call is behind the weights
being trained (``trained_version - oldest call's version``). With a bound ``max_staleness=K`` a
group older than K is not trained: it is dropped (its sample is skipped) or requeued (its sample
runs again as a fresh group), and counted either way. K=0 is on-policy training. verl's V1
trainer calls the same bound ``max_off_policy_threshold``. A group with a call recorded at a
version above the trained one (served by a dead run's weights, after a resume) is never trained.

:class:`Admission` is the one place that says how many groups the collector may hold: the three
training modes are three settings of it.
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


def is_ahead(group: CarriedGroup, trained_version: int) -> bool:
    """Whether a call of ``group`` was served by weights newer than ``trained_version`` (impossible
    in one run: such calls come from a run that died after publishing them)."""
    span = group.version_span()
    return span is not None and span[1] > trained_version


DEFAULT_UNBOUNDED_STEPS_AHEAD = 2
"""With no staleness bound, fully async holds as many groups as with K = 2 unless told otherwise."""


@dataclass(frozen=True)
class Admission:
    """How many GRPO groups the collector may hold (running or complete, not yet taken).

    ``groups_per_step`` is one step's generation batch; ``max_groups`` caps the groups held;
    ``max_staleness`` is the bound K (``None``: none); ``overlap`` admits groups while a taken
    step trains (fully async) instead of only between steps (sync and carry-over async, where
    the gateway is paused while the actor trains).

    - sync: ``Admission(G, G, 0, overlap=False)``: one step's batch, started after the publish;
    - carry-over async: ``Admission(G, M, None, overlap=False)`` with ``M > G``: unfinished and
      surplus groups are carried into the next step;
    - fully async: ``Admission(G, M, K, overlap=True)``: AReaL's rule, at most ``(K + 1) x G``
      groups between steps and ``K x G`` while a taken step trains, so with K=0 no group starts
      before the weights it will be trained against are published.
    """

    groups_per_step: int
    max_groups: int
    max_staleness: int | None
    overlap: bool

    def __post_init__(self) -> None:
        if self.groups_per_step < 1:
            raise ValueError(f"groups_per_step must be >= 1, got {self.groups_per_step}")
        if self.max_groups < self.groups_per_step:
            raise ValueError(
                f"max_groups ({self.max_groups}) must be >= groups_per_step ({self.groups_per_step}): "
                "a step needs its whole generation batch held at once"
            )
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None (no bound), got {self.max_staleness}")

    @classmethod
    def sync(cls, groups_per_step: int) -> Admission:
        """One step's generation batch, admitted once the previous step's weights are published."""
        return cls(groups_per_step, groups_per_step, 0, overlap=False)

    @classmethod
    def carry_over(cls, groups_per_step: int, max_groups: int) -> Admission:
        """Up to ``max_groups`` groups between steps; what a step does not take carries over."""
        return cls(groups_per_step, max_groups, None, overlap=False)

    @classmethod
    def fully_async(
        cls, groups_per_step: int, max_staleness: int | None, max_groups: int | None = None
    ) -> Admission:
        """Groups run through the update, up to ``(K + 1) x groups_per_step`` held (``max_groups``
        caps it; with no bound K, as many as with K = 2)."""
        bound = DEFAULT_UNBOUNDED_STEPS_AHEAD if max_staleness is None else max_staleness
        held = max_groups or (bound + 1) * groups_per_step
        return cls(groups_per_step, held, max_staleness, overlap=True)

    def limit(self, step_open: bool) -> int:
        """The groups that may be held now; ``step_open``: a taken step is training."""
        if step_open and not self.overlap:
            return 0
        if self.max_staleness is None:
            return self.max_groups
        steps_ahead = self.max_staleness + 1 - int(step_open)
        return max(0, min(self.max_groups, steps_ahead * self.groups_per_step))


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


__all__ = ("STALE_STRATEGIES", "Admission", "StaleStrategy", "StalenessGate", "group_age", "is_ahead")
