"""Stage 8: one rollout, one vote, whatever the loss mode.

With ``algorithm.normalize_by_rollout: true`` (the default) each row's advantages are divided by its
rollout's trained tokens times the step's count (``algorithm.per_rollout_divisor``: distinct rollouts,
or 1.0.2's trained rows), and the policy loss sums its tokens: the loss is then the mean over rollouts
of each rollout's token mean, however many rows a rollout spans (a template or retokenisation
mismatch, or ``level=transition``). ``actor.loss_agg_mode`` is honoured with rollouts as the
sequences: ``seq-mean-token-sum`` drops the division by tokens, ``seq-mean-token-sum-norm`` divides
by ``actor.loss_scale_factor`` (default: the max response length) instead (Dr. GRPO), ``token-sum``
divides by nothing; ``token-mean``, verl's default, is taken as ``seq-mean-token-mean``. agl's own losses sum by construction; verl's token-level losses
run as their ``rollout_summed:<mode>`` registrations (agl-algos), which sum the policy term and
leave the entropy and KL terms to ``loss_agg_mode``. Sequence-level verl losses take their ratio per
row and are refused (``gspo_per_rollout`` and ``geo_mean_per_rollout`` take theirs per rollout).

``false`` trains every verl loss per row as verl does (``loss_agg_mode`` applies); agl's per-rollout
losses need the division and refuse it.
"""

from __future__ import annotations

from typing import Any

import torch
from verl import DataProto

from agl_algos import (
    GEO_MEAN_PER_ROLLOUT_LOSS_MODE,
    GSPO_PER_ROLLOUT_LOSS_MODE,
    normalize_advantages_by_rollout,
    rollout_index_of,
    rows_per_rollout_metrics,
)
from agl_algos.verl import ROLLOUT_INDEX_KEY
from agl_trainer.settings import NormalizationSettings

__all__ = ("normalize_by_rollout",)


def normalize_by_rollout(
    batch: DataProto, settings: NormalizationSettings
) -> tuple[DataProto, dict[str, Any]]:
    """Divide ``batch``'s advantages per rollout over the whole step (when enabled), give
    ``gspo_per_rollout`` and ``geo_mean_per_rollout`` their ``rollout_index``, and log
    ``training/rows_per_rollout_mean``."""
    rollout_ids = batch.non_tensor_batch["rollout_id_list"]
    metrics = rows_per_rollout_metrics(rollout_ids)
    if not settings.enabled:
        return batch, metrics
    batch.batch["advantages"] = normalize_advantages_by_rollout(
        batch.batch["advantages"],
        batch.batch["response_mask"],
        rollout_ids,
        divisor=settings.divisor,
        num_trained_rows=len(batch),
        loss_agg_mode=settings.loss_agg_mode,
        loss_scale_factor=settings.loss_scale_factor,
    )
    if settings.loss_mode in (GSPO_PER_ROLLOUT_LOSS_MODE, GEO_MEAN_PER_ROLLOUT_LOSS_MODE):
        batch.batch[ROLLOUT_INDEX_KEY] = rollout_index_of(rollout_ids).to(torch.int64)
    return batch, metrics
