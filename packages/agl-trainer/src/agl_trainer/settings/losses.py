"""Settings of the stages between the adapter and the update: the batch cut, DAPO's overlong
shaping, the advantages and the per-rollout normalisation."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from agl_algos import (
    ROLLOUT_DIVISORS,
    ROLLOUT_LOSS_AGG_MODES,
    OverlongBuffer,
    RolloutDivisor,
    RolloutLossAggMode,
)
from agl_algos.verl import POLICY_LOSSES, ROLLOUT_SUMMED_PREFIX, VERL_TOKEN_LEVEL_LOSSES
from agl_trainer.settings.values import flag, integer, one_of, optional_integer, positive, section, select

OVERLONG_KEY = "reward.reward_kwargs.overlong_buffer_cfg"
NORMALIZE_KEY = "algorithm.normalize_by_rollout"
DIVISOR_KEY = "algorithm.per_rollout_divisor"
LOSS_MODE_KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"


@dataclass(frozen=True, kw_only=True)
class BatchSettings:
    """How the adapter's rows are cut to what the actor trains: whole mini-batches of
    ``ppo_mini_batch_size x rollout.n`` rows, at most ``max_ppo_update_times`` of them."""

    mini_batch_rows: int
    max_ppo_update_times: int | None
    seed: int
    balance: bool
    """``trainer.balance_batch``: verl reorders rows so every data-parallel rank gets as many tokens."""
    temperature: float


@dataclass(frozen=True)
class OverlongSettings:
    """DAPO's overlong penalty (``reward.reward_kwargs.overlong_buffer_cfg``) when enabled."""

    buffer: OverlongBuffer


@dataclass(frozen=True, kw_only=True)
class AdvantageSettings:
    """``algorithm.*``: the estimator, rollout-level or not, and the KL in the reward."""

    algorithm: Mapping[str, Any]
    """verl's ``algorithm`` section, as its estimators read it."""
    num_repeat: int
    rollout_level: bool
    use_critic: bool


@dataclass(frozen=True, kw_only=True)
class NormalizationSettings:
    """``algorithm.normalize_by_rollout`` and ``per_rollout_divisor``, checked against the loss mode."""

    enabled: bool
    divisor: RolloutDivisor
    loss_mode: str
    """The actor's loss mode as configured (without agl's ``rollout_summed:`` prefix)."""
    loss_agg_mode: RolloutLossAggMode = "seq-mean-token-mean"
    loss_scale_factor: float | None = None


def parse_batch(config: DictConfig) -> BatchSettings:
    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    key = "agentlightning.max_ppo_update_times"
    return BatchSettings(
        mini_batch_rows=integer(
            "actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size, minimum=1
        )
        * int(rollout.n),
        max_ppo_update_times=optional_integer(key, select(config, key), minimum=1),
        seed=int(actor.get("data_loader_seed") or 0),
        balance=bool(config.trainer.balance_batch),
        temperature=float(rollout.temperature),
    )


def parse_overlong(config: DictConfig, max_response_length: int) -> OverlongSettings | None:
    """None unless ``overlong_buffer_cfg.enable``; the length defaults to ``reward_kwargs.max_resp_len``,
    else the adapter's ``max_response_length``."""
    kwargs = section(select(config, "reward.reward_kwargs"))
    buffer = section(kwargs.get("overlong_buffer_cfg"))
    if not flag(f"{OVERLONG_KEY}.enable", buffer.get("enable", False)):
        return None
    max_len = kwargs.get("max_resp_len") or max_response_length
    try:
        return OverlongSettings(OverlongBuffer.from_config(buffer, int(max_len)))
    except ValueError as error:
        raise ValueError(f"{OVERLONG_KEY}: {error}") from error


def parse_advantages(config: DictConfig, *, use_critic: bool) -> AdvantageSettings:
    algorithm = config.algorithm
    estimator = str(algorithm.adv_estimator).lower()
    rollout_level = flag(
        "algorithm.enable_rollout_level_advantage", algorithm.get("enable_rollout_level_advantage", False)
    )
    if estimator == "remax":
        raise ValueError(
            "algorithm.adv_estimator=remax is not supported by agl (its baseline needs in-process greedy "
            "generation); use grpo, rloo or another outcome estimator"
        )
    if estimator == "gae" and rollout_level:
        raise ValueError(
            "algorithm.enable_rollout_level_advantage=true needs an outcome estimator (one scalar per "
            "rollout), but algorithm.adv_estimator=gae gives per-token advantages; set "
            "algorithm.enable_rollout_level_advantage=false to train with GAE and a critic"
        )
    return AdvantageSettings(
        algorithm=algorithm,
        num_repeat=int(config.actor_rollout_ref.rollout.n),
        rollout_level=rollout_level,
        use_critic=use_critic,
    )


def parse_normalization(config: DictConfig, max_response_length: int) -> NormalizationSettings:
    """Raises ``ValueError`` naming the key and the fix when the loss cannot weigh rollouts equally."""
    enabled = flag(NORMALIZE_KEY, select(config, NORMALIZE_KEY, True))
    divisor: RolloutDivisor = one_of(DIVISOR_KEY, select(config, DIVISOR_KEY, "rollouts"), ROLLOUT_DIVISORS)
    loss_mode = str(config.actor_rollout_ref.actor.policy_loss.loss_mode).removeprefix(ROLLOUT_SUMMED_PREFIX)
    ours = loss_mode in POLICY_LOSSES
    if ours and not enabled:
        raise ValueError(
            f"{LOSS_MODE_KEY}={loss_mode!r} sums tokens of per-rollout advantages and needs "
            f"{NORMALIZE_KEY}=true; set it, or pick a verl loss mode (e.g. vanilla) to train per row"
        )
    if enabled and not ours:
        _check_verl_mode_sums(loss_mode, config)
    actor = config.actor_rollout_ref.actor
    agg_key = "actor_rollout_ref.actor.loss_agg_mode"
    agg = str(actor.get("loss_agg_mode", "token-mean"))
    agg_mode: RolloutLossAggMode = (
        one_of(agg_key, agg, ROLLOUT_LOSS_AGG_MODES) if enabled else "seq-mean-token-mean"
    )
    scale = actor.get("loss_scale_factor") or max_response_length
    return NormalizationSettings(
        enabled=enabled,
        divisor=divisor,
        loss_mode=loss_mode,
        loss_agg_mode=agg_mode,
        loss_scale_factor=positive("actor_rollout_ref.actor.loss_scale_factor", scale),
    )


def _check_verl_mode_sums(loss_mode: str, config: DictConfig) -> None:
    """A verl loss under normalisation must be one that can sum its tokens, outside bypass mode."""
    if loss_mode not in VERL_TOKEN_LEVEL_LOSSES:
        hint = f"use {loss_mode}_per_rollout, " if loss_mode in ("gspo", "geo_mean") else ""
        raise ValueError(
            f"{LOSS_MODE_KEY}={loss_mode!r} takes its ratio or aggregation per row, so it cannot weigh "
            f"rollouts equally under {NORMALIZE_KEY}=true; {hint}pick one of "
            f"{sorted(VERL_TOKEN_LEVEL_LOSSES + tuple(POLICY_LOSSES))}, or set {NORMALIZE_KEY}=false to "
            "train it per row"
        )
    if select(config, "algorithm.rollout_correction.bypass_mode", False):
        raise ValueError(
            f"algorithm.rollout_correction.bypass_mode=true replaces {LOSS_MODE_KEY}={loss_mode!r} with "
            f"verl's bypass_mode loss, which aggregates per row; under {NORMALIZE_KEY}=true use "
            "per_rollout_mean (it honours bypass mode), or set the normalisation to false"
        )


__all__ = (
    "DIVISOR_KEY",
    "LOSS_MODE_KEY",
    "NORMALIZE_KEY",
    "OVERLONG_KEY",
    "AdvantageSettings",
    "BatchSettings",
    "NormalizationSettings",
    "OverlongSettings",
    "parse_advantages",
    "parse_batch",
    "parse_normalization",
    "parse_overlong",
)
