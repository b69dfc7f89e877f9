"""Per-rollout-mean PPO loss: every rollout weighs the same in the gradient, whatever its length.

verl's token-mean loss lets a rollout with many tokens dominate the gradient. Here each row's advantage is
first divided by (trained tokens of its whole rollout x trained rows of the step), then the clipped PPO
objective is summed over tokens. A rollout-constant advantage A_r then contributes a total weight
A_r / N_trained, the same for a 20-token answer and a 20k-token multi-turn trajectory.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from agl_algos._ids import IdArray, factorize
from agl_algos.config import PolicyLossConfig

__all__ = (
    "LOG_RATIO_CLAMP",
    "PER_ROLLOUT_MEAN_LOSS_MODE",
    "compute_policy_loss_per_rollout_mean",
    "normalize_advantages_by_rollout",
)

PER_ROLLOUT_MEAN_LOSS_MODE = "per_rollout_mean"
"""The ``actor.policy_loss.loss_mode`` name the loss is registered under in verl."""

CodeArray = npt.NDArray[np.int64] | torch.Tensor
"""Rollout codes, one int64 per row."""

LOG_RATIO_CLAMP = 20.0
"""log(pi/pi_old) is clamped to [-20, 20] before exp, as in verl, so the ratio never overflows."""


def _codes(
    rollout_ids: IdArray, rollout_codes: CodeArray | None, n_rows: int, device: torch.device
) -> torch.Tensor:
    """Rollout codes (N,) int64 in [0, N) on ``device``: the given ones once checked, else factorised."""
    if rollout_codes is None:
        return torch.as_tensor(factorize(rollout_ids, name="rollout_ids").codes, device=device)
    codes = torch.as_tensor(rollout_codes, device=device)
    if codes.dtype != torch.int64 or codes.shape != (n_rows,):
        raise ValueError(
            f"rollout_codes must be int64 of shape ({n_rows},), got {codes.dtype} {tuple(codes.shape)}; "
            "pass RolloutLevelAdvantage.layout.rollout_of_row"
        )
    if n_rows and bool(((codes < 0) | (codes >= n_rows)).any()):
        raise ValueError(
            f"rollout_codes must be codes in [0, {n_rows}) (one per rollout), got min {int(codes.min())} "
            f"and max {int(codes.max())}; pass RolloutLevelAdvantage.layout.rollout_of_row"
        )
    return codes


def normalize_advantages_by_rollout(
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_ids: IdArray,
    *,
    num_trained_rows: int,
    rollout_codes: CodeArray | None = None,
) -> torch.Tensor:
    """Divide each row's advantages by (trained tokens of its rollout x ``num_trained_rows``).

    ``advantages``, ``response_mask`` (N, T); ``rollout_ids`` (N,) -> (N, T) in the advantages' dtype.
    The divisor is clamped at 1. ``num_trained_rows`` is the step's whole trained batch (not a
    mini-batch), so mini-batch updates sum to the same total. ``rollout_codes`` (N,) int64, optional:
    the rollouts already numbered (``RolloutLevelAdvantage.layout.rollout_of_row``), trusted to match
    ``rollout_ids`` (only dtype, shape and range are checked) so the ids are not grouped again.
    Cost: one Python pass over the ids (none with ``rollout_codes``) and one scatter-add.
    """
    n_rows = advantages.shape[0]
    if len(rollout_ids) != n_rows:
        raise ValueError(f"rollout_ids length ({len(rollout_ids)}) must match advantages rows ({n_rows})")
    if num_trained_rows <= 0:
        raise ValueError(f"num_trained_rows must be positive, got {num_trained_rows}; pass len(batch)")
    if response_mask.shape != advantages.shape:
        raise ValueError(
            f"response_mask {tuple(response_mask.shape)} must have the shape of advantages "
            f"{tuple(advantages.shape)}"
        )
    codes = _codes(rollout_ids, rollout_codes, n_rows, advantages.device)
    row_tokens = response_mask.sum(-1, dtype=torch.int64)
    rollout_tokens = torch.zeros(n_rows, dtype=torch.int64, device=advantages.device)
    rollout_tokens.index_add_(0, codes, row_tokens)
    divisor = (rollout_tokens[codes] * num_trained_rows).clamp_min(1).to(advantages.dtype)
    return advantages / divisor.unsqueeze(-1)


def compute_policy_loss_per_rollout_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Dual-clip PPO objective summed over trained tokens and scaled by the data-parallel size.

    All tensors (B, T); ``advantages`` already normalised by :func:`normalize_advantages_by_rollout`.
    ``config`` is verl's actor config, a mapping or a :class:`PolicyLossConfig`. ``loss_agg_mode`` is
    accepted for verl's policy-loss signature and ignored: the aggregation is always the masked sum.
    Returns the scalar loss and ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``
    (masked means, Python floats). The response mask is read as boolean.
    """
    params = PolicyLossConfig.from_actor_config(config)
    mask = response_mask.bool()
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - params.low, 1.0 + params.high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * params.clip_ratio_c
    negative = advantages < 0
    token_loss = torch.where(negative, torch.minimum(dual_bound, clip_loss), clip_loss)
    if rollout_is_weights is not None:
        token_loss = token_loss * rollout_is_weights
    loss = torch.where(mask, token_loss, 0.0).sum() * params.dp_size

    with torch.no_grad():
        denominator = mask.sum(dtype=torch.float32) + 1e-8
        stats = torch.stack(
            (
                (mask & (clipped > unclipped)).sum(dtype=torch.float32),
                torch.where(mask, -log_ratio, 0.0).sum(dtype=torch.float32),
                (mask & negative & (clip_loss > dual_bound)).sum(dtype=torch.float32),
            )
        )
        clipfrac, ppo_kl, clipfrac_lower = (stats / denominator).tolist()
    metrics: dict[str, Any] = {
        "actor/pg_clipfrac": clipfrac,
        "actor/ppo_kl": ppo_kl,
        "actor/pg_clipfrac_lower": clipfrac_lower,
    }
    return loss, metrics
