"""Pipeline stage 1b: DAPO's dynamic sampling on complete groups, from verl's ``algorithm.filter_groups``.

With ``filter_groups.enable: true`` a GRPO group (the rollouts of one sample) whose rewards are all
equal carries no advantage and is let go by the collector's take instead of being trained; its
place is refilled with a new sample (in every mode: the collector admits one as the filtered group
frees its slot), until ``train_batch_size`` groups with a signal are kept. After
``max_num_gen_batches`` generation batches' worth of groups (0 or less: no limit) the step trains
on what it kept and says so in the log; a step that kept none trains nothing, with a warning.

Metrics: ``training/dynamic_sampling/groups_kept``, ``..._filtered`` and ``..._gen_batches`` (groups
examined over the generation batch size, rounded up). A rollout's reward is its ``final_reward``
(``reward_fillna_value`` when it has none), as the adapter scores it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
from omegaconf import DictConfig

from agl_algos import filter_zero_variance_groups
from agl_algos.dapo import DYNAMIC_SAMPLING_METRIC_PREFIX
from agl_rollout import CarriedGroup, CollectedGroups

__all__ = ("FILTER_GROUPS_KEY", "DynamicSampling")

logger = logging.getLogger("agl_trainer")

FILTER_GROUPS_KEY = "algorithm.filter_groups"


@dataclass(frozen=True, slots=True)
class DynamicSampling:
    """``algorithm.filter_groups``: which groups a step keeps, and when it stops looking."""

    max_num_gen_batches: int
    reward_fillna_value: float

    @classmethod
    def from_config(cls, config: DictConfig, reward_fillna_value: float) -> DynamicSampling | None:
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
        return cls(int(section.get("max_num_gen_batches") or 0), reward_fillna_value)

    def keeps(self, group: CarriedGroup) -> bool:
        """Whether the group's rewards differ (a group of one rollout is kept, as in DAPO and verl)."""
        rewards = [
            self.reward_fillna_value if r.final_reward is None else float(r.final_reward)
            for r in group.completed
        ]
        ids = np.array([group.data_id] * len(rewards), dtype=object)
        return filter_zero_variance_groups(rewards, ids).n_groups_kept == 1

    def max_examined(self, gen_batch_size: int) -> int | None:
        """How many groups a step may look at: ``max_num_gen_batches`` generation batches (None: no limit)."""
        return self.max_num_gen_batches * gen_batch_size if self.max_num_gen_batches > 0 else None

    def metrics(
        self, collected: CollectedGroups, *, gen_batch_size: int, train_batch_size: int, step: int
    ) -> dict[str, float]:
        """The step's dynamic-sampling metrics; a short step is logged."""
        gen_batches = math.ceil(collected.n_examined / gen_batch_size)
        if collected.short:
            logger.warning(
                "step %d: dynamic sampling kept %d of %d groups after %d generation batches "
                "(%s.max_num_gen_batches=%d); training on what there is",
                step,
                len(collected.groups),
                train_batch_size,
                gen_batches,
                FILTER_GROUPS_KEY,
                self.max_num_gen_batches,
            )
        return {
            f"{DYNAMIC_SAMPLING_METRIC_PREFIX}groups_kept": float(len(collected.groups)),
            f"{DYNAMIC_SAMPLING_METRIC_PREFIX}groups_filtered": float(collected.n_filtered),
            f"{DYNAMIC_SAMPLING_METRIC_PREFIX}gen_batches": float(gen_batches),
        }
