"""Pipeline stage 1b: DAPO's dynamic sampling on completed rollouts, from verl's ``algorithm.filter_groups``.

With ``filter_groups.enable: true`` a GRPO group (the rollouts of one sample) whose rewards are all
equal carries no advantage and is dropped before the adapter. While fewer than ``train_batch_size``
groups are kept, another generation batch is collected (sync and carry-over async modes alike), up
to ``max_num_gen_batches`` in all (0 or less: no limit); then the step trains on what it has and
says so in the log. Groups beyond ``train_batch_size`` are left out (verl's DAPO does the same) and
counted. In the fully-async mode the collector admits one step's groups per update, so the step
filters the groups it takes without generating more.

Metrics: ``training/dynamic_sampling/groups_kept``, ``..._filtered``, ``..._gen_batches`` and
``..._groups_surplus``. A rollout's reward is its ``final_reward`` (``reward_fillna_value`` when it
has none), as the adapter scores it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from omegaconf import DictConfig

from agl_algos import filter_zero_variance_groups
from agl_algos.dapo import DYNAMIC_SAMPLING_METRIC_PREFIX
from agl_trainer.settings import AglSettings
from agl_types import CompletedRollout

__all__ = ("FILTER_GROUPS_KEY", "DynamicSampling")

logger = logging.getLogger("agl_trainer")

FILTER_GROUPS_KEY = "algorithm.filter_groups"

Take = Callable[[], tuple[list[CompletedRollout], dict[str, float]]]
"""One generation batch's completed rollouts and the collection's metrics."""


@dataclass(frozen=True, slots=True)
class DynamicSampling:
    """``algorithm.filter_groups``; :meth:`collect` fills a step with groups that carry a signal."""

    max_num_gen_batches: int
    reward_fillna_value: float
    refill: bool

    @classmethod
    def from_config(cls, config: DictConfig, settings: AglSettings) -> DynamicSampling | None:
        """None unless ``filter_groups.enable``; a ``metric`` other than ``reward`` raises ``ValueError``
        (agl scores a rollout by its one reward; verl's other metrics come from its reward manager)."""
        section = config.algorithm.get("filter_groups") or {}
        if not section.get("enable", False):
            return None
        metric = section.get("metric", "reward")
        if metric not in ("reward", None):
            raise ValueError(
                f"{FILTER_GROUPS_KEY}.metric={metric!r}; agl filters on each rollout's reward, set it to reward"
            )
        return cls(
            int(section.get("max_num_gen_batches") or 0),
            settings.reward_fillna_value,
            refill=not settings.fully_async,
        )

    def collect(
        self, take: Take, train_batch_size: int, step: int
    ) -> tuple[list[CompletedRollout], dict[str, float]]:
        """Call ``take`` until ``train_batch_size`` groups with differing rewards are kept or the
        limit is reached; return the kept groups' rollouts (siblings adjacent) and the metrics (the
        collection's are the last generation batch's)."""
        kept: list[list[CompletedRollout]] = []
        n_filtered = gen_batches = 0
        metrics: dict[str, float] = {}
        while True:
            rollouts, metrics = take()
            gen_batches += 1
            groups, n_dropped = self._filter(rollouts)
            kept += groups
            n_filtered += n_dropped
            limit_hit = 0 < self.max_num_gen_batches <= gen_batches
            if len(kept) >= train_batch_size or not self.refill or limit_hit or not rollouts:
                break
        if len(kept) < train_batch_size and self.refill:
            logger.warning(
                "step %d: dynamic sampling kept %d of %d groups after %d generation batches "
                "(%s.max_num_gen_batches=%d); training on what there is",
                step,
                len(kept),
                train_batch_size,
                gen_batches,
                FILTER_GROUPS_KEY,
                self.max_num_gen_batches,
            )
        surplus = max(len(kept) - train_batch_size, 0)
        trained = kept[:train_batch_size]
        return [rollout for group in trained for rollout in group], {
            **metrics,
            f"{DYNAMIC_SAMPLING_METRIC_PREFIX}groups_kept": len(trained),
            f"{DYNAMIC_SAMPLING_METRIC_PREFIX}groups_filtered": n_filtered,
            f"{DYNAMIC_SAMPLING_METRIC_PREFIX}gen_batches": gen_batches,
            f"{DYNAMIC_SAMPLING_METRIC_PREFIX}groups_surplus": surplus,
        }

    def _filter(self, rollouts: list[CompletedRollout]) -> tuple[list[list[CompletedRollout]], int]:
        """The groups of ``rollouts`` whose rewards differ (or that hold one rollout), and how many
        groups were dropped."""
        if not rollouts:
            return [], 0
        rewards = [
            self.reward_fillna_value if r.final_reward is None else float(r.final_reward) for r in rollouts
        ]
        result = filter_zero_variance_groups(rewards, np.array([r.data_id for r in rollouts], dtype=object))
        kept_ids = {rollouts[i].data_id for i in result.kept.tolist()}
        groups: dict[str, list[CompletedRollout]] = {}
        for rollout in rollouts:
            if rollout.data_id in kept_ids:
                groups.setdefault(rollout.data_id, []).append(rollout)
        return list(groups.values()), result.n_groups_filtered
