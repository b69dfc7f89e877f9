"""Pipeline stage 2c: one rollout, one vote, whatever the loss mode.

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

from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, open_dict
from verl import DataProto

from agl_algos import (
    GEO_MEAN_PER_ROLLOUT_LOSS_MODE,
    GSPO_PER_ROLLOUT_LOSS_MODE,
    ROLLOUT_DIVISORS,
    ROLLOUT_LOSS_AGG_MODES,
    RolloutDivisor,
    RolloutLossAggMode,
    normalize_advantages_by_rollout,
    rollout_index_of,
    rows_per_rollout_metrics,
)
from agl_algos.verl import (
    POLICY_LOSSES,
    ROLLOUT_INDEX_KEY,
    ROLLOUT_SUMMED_PREFIX,
    VERL_TOKEN_LEVEL_LOSSES,
    rollout_summed_name,
)
from agl_trainer.settings import AglSettings

__all__ = ("NORMALIZE_KEY", "RolloutNormalization")

NORMALIZE_KEY = "algorithm.normalize_by_rollout"
_DIVISOR_KEY = "algorithm.per_rollout_divisor"
_LOSS_MODE_KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"


@dataclass(frozen=True, slots=True)
class RolloutNormalization:
    """``algorithm.normalize_by_rollout`` and ``algorithm.per_rollout_divisor``, checked against the
    loss mode; :meth:`configure_actor` picks the summed verl loss, :meth:`apply` divides a step's
    advantages."""

    enabled: bool
    divisor: RolloutDivisor
    loss_mode: str
    loss_agg_mode: RolloutLossAggMode = "seq-mean-token-mean"
    loss_scale_factor: float | None = None

    @classmethod
    def from_config(cls, config: DictConfig) -> RolloutNormalization:
        """Read and check the keys; raises ``ValueError`` naming the key and the fix."""
        algorithm = config.algorithm
        enabled = algorithm.get("normalize_by_rollout", True)
        if not isinstance(enabled, bool):
            raise ValueError(f"{NORMALIZE_KEY}={enabled!r}; set it to true or false")
        divisor = str(algorithm.get("per_rollout_divisor", "rollouts"))
        if divisor not in ROLLOUT_DIVISORS:
            raise ValueError(
                f"{_DIVISOR_KEY}={divisor!r}; supported: {list(ROLLOUT_DIVISORS)} ('rollouts': one rollout, "
                "one vote; 'rows': Agent Lightning 1.0.2's divisor)"
            )
        loss_mode = str(config.actor_rollout_ref.actor.policy_loss.loss_mode).removeprefix(
            ROLLOUT_SUMMED_PREFIX
        )
        ours = loss_mode in POLICY_LOSSES
        if ours and not enabled:
            raise ValueError(
                f"{_LOSS_MODE_KEY}={loss_mode!r} sums tokens of per-rollout advantages and needs "
                f"{NORMALIZE_KEY}=true; set it, or pick a verl loss mode (e.g. vanilla) to train per row"
            )
        if enabled and not ours:
            _check_verl_mode_sums(loss_mode, config)
        actor = config.actor_rollout_ref.actor
        agg = str(actor.get("loss_agg_mode", "token-mean"))
        if enabled and agg not in ROLLOUT_LOSS_AGG_MODES:
            raise ValueError(
                f"actor_rollout_ref.actor.loss_agg_mode={agg!r}; under {NORMALIZE_KEY}=true supported: "
                f"{list(ROLLOUT_LOSS_AGG_MODES)}"
            )
        scale = actor.get("loss_scale_factor") or AglSettings.from_config(config).max_response_length
        return cls(enabled, divisor, loss_mode, agg, float(scale))  # pyright: ignore[reportArgumentType]  (checked above)

    def configure_actor(self, config: DictConfig) -> None:
        """Point the actor at ``rollout_summed:<mode>`` for a verl loss under normalisation; else no-op.

        Call it before the workers are built (they copy the actor config). Idempotent.
        """
        if self.enabled and self.loss_mode not in POLICY_LOSSES:
            with open_dict(config.actor_rollout_ref.actor.policy_loss):
                config.actor_rollout_ref.actor.policy_loss.loss_mode = rollout_summed_name(self.loss_mode)

    def apply(self, batch: DataProto, metrics: dict[str, Any]) -> None:
        """Divide ``batch``'s advantages per rollout over the whole step (when enabled), give
        ``gspo_per_rollout`` and ``geo_mean_per_rollout`` their ``rollout_index``, and log ``training/rows_per_rollout_mean``."""
        rollout_ids = batch.non_tensor_batch["rollout_id_list"]
        metrics.update(rows_per_rollout_metrics(rollout_ids))
        if not self.enabled:
            return
        batch.batch["advantages"] = normalize_advantages_by_rollout(
            batch.batch["advantages"],
            batch.batch["response_mask"],
            rollout_ids,
            divisor=self.divisor,
            num_trained_rows=len(batch),
            loss_agg_mode=self.loss_agg_mode,
            loss_scale_factor=self.loss_scale_factor,
        )
        if self.loss_mode in (GSPO_PER_ROLLOUT_LOSS_MODE, GEO_MEAN_PER_ROLLOUT_LOSS_MODE):
            batch.batch[ROLLOUT_INDEX_KEY] = rollout_index_of(rollout_ids).to(torch.int64)


def _check_verl_mode_sums(loss_mode: str, config: DictConfig) -> None:
    """A verl loss under normalisation must be one that can sum its tokens, outside bypass mode."""
    if loss_mode not in VERL_TOKEN_LEVEL_LOSSES:
        hint = f"use {loss_mode}_per_rollout, " if loss_mode in ("gspo", "geo_mean") else ""
        raise ValueError(
            f"{_LOSS_MODE_KEY}={loss_mode!r} takes its ratio or aggregation per row, so it cannot weigh "
            f"rollouts equally under {NORMALIZE_KEY}=true; {hint}pick one of "
            f"{sorted(VERL_TOKEN_LEVEL_LOSSES + tuple(POLICY_LOSSES))}, or set {NORMALIZE_KEY}=false to "
            "train it per row"
        )
    correction = config.algorithm.get("rollout_correction") or {}
    if correction.get("bypass_mode", False):
        raise ValueError(
            f"algorithm.rollout_correction.bypass_mode=true replaces {_LOSS_MODE_KEY}={loss_mode!r} with "
            f"verl's bypass_mode loss, which aggregates per row; under {NORMALIZE_KEY}=true use "
            "per_rollout_mean (it honours bypass mode), or set the normalisation to false"
        )
