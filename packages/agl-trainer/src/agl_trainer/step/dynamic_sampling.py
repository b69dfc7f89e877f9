"""Stage 1, within collection: DAPO's dynamic sampling on complete groups (``algorithm.filter_groups``).

A GRPO group (the rollouts of one sample) whose rewards are all equal carries no advantage and is
let go by the collector's take instead of being trained; its place is refilled with a new sample
(in every mode: the collector admits one as the filtered group frees its slot), until
``train_batch_size`` groups with a signal are kept. After ``max_num_gen_batches`` generation
batches' worth of groups (0: no limit) the step trains on what it kept and says so in the log; a
step that kept none trains nothing, with a warning.

Metrics: ``training/dynamic_sampling/groups_kept``, ``..._filtered`` and ``..._gen_batches`` (groups
examined over the generation batch size, rounded up). A rollout's reward is its ``final_reward``
(``reward_fillna_value`` when it has none), as the adapter scores it.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from agl_algos import filter_zero_variance_groups
from agl_algos.dapo import DYNAMIC_SAMPLING_METRIC_PREFIX
from agl_rollout import CarriedGroup, CollectedGroups
from agl_trainer.settings import DynamicSamplingSettings
from agl_trainer.settings.pipeline import FILTER_GROUPS_KEY

__all__ = ("dynamic_sampling_metrics", "keeps_group", "max_groups_examined")

logger = logging.getLogger("agl_trainer")


def keeps_group(group: CarriedGroup, settings: DynamicSamplingSettings) -> bool:
    """Whether the group's rewards differ (a group of one rollout is kept, as in DAPO and verl)."""
    rewards = [
        settings.reward_fillna_value if r.final_reward is None else float(r.final_reward)
        for r in group.completed
    ]
    ids = np.array([group.data_id] * len(rewards), dtype=object)
    return filter_zero_variance_groups(rewards, ids).n_groups_kept == 1


def max_groups_examined(settings: DynamicSamplingSettings, gen_batch_size: int) -> int | None:
    """How many groups a step may look at: ``max_num_gen_batches`` generation batches (None: no limit)."""
    return settings.max_num_gen_batches * gen_batch_size if settings.max_num_gen_batches > 0 else None


def dynamic_sampling_metrics(
    collected: CollectedGroups,
    settings: DynamicSamplingSettings,
    *,
    gen_batch_size: int,
    train_batch_size: int,
    step: int,
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
            settings.max_num_gen_batches,
        )
    return {
        f"{DYNAMIC_SAMPLING_METRIC_PREFIX}groups_kept": float(len(collected.groups)),
        f"{DYNAMIC_SAMPLING_METRIC_PREFIX}groups_filtered": float(collected.n_filtered),
        f"{DYNAMIC_SAMPLING_METRIC_PREFIX}gen_batches": float(gen_batches),
    }
