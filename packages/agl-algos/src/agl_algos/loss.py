"""Per-rollout losses: every rollout weighs the same in the gradient, however long it is and however
many rows it spans.

verl's token-mean loss lets a rollout with many tokens dominate the gradient. Here each row's advantage is
first divided by (trained tokens of its whole rollout x the step's rollout count), then a policy objective
is summed over tokens. A rollout-constant advantage A_r then contributes a total weight A_r / R, the same
for a 20-token answer and a 20k-token multi-turn trajectory split into five rows. Three objectives:

- ``per_rollout_mean``: dual-clip PPO (Ye et al. 2019, arXiv:1912.09729);
- ``cispo_per_rollout_mean``: CISPO (MiniMax-M1, arXiv:2506.13585), the clipped ratio detached, as
  Agent Lightning 1.0.2 defines it;
- ``gspo_per_rollout``: GSPO (Zheng et al. 2025, arXiv:2507.18071) with the sequence-level ratio
  taken over a whole rollout's tokens instead of one row's.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Literal, get_args

import numpy as np
import numpy.typing as npt
import torch

from agl_algos._ids import IdArray, factorize
from agl_algos.config import PolicyLossConfig

__all__ = (
    "CISPO_PER_ROLLOUT_MEAN_LOSS_MODE",
    "GEO_MEAN_PER_ROLLOUT_LOSS_MODE",
    "GSPO_PER_ROLLOUT_LOSS_MODE",
    "GSPO_LOG_RATIO_MAX",
    "LOG_RATIO_CLAMP",
    "PER_ROLLOUT_MEAN_LOSS_MODE",
    "ROLLOUT_DIVISORS",
    "ROLLOUT_LOSS_AGG_MODES",
    "RolloutDivisor",
    "RolloutLossAggMode",
    "compute_policy_loss_cispo_per_rollout_mean",
    "compute_policy_loss_geo_mean_per_rollout",
    "compute_policy_loss_gspo_per_rollout",
    "compute_policy_loss_per_rollout_mean",
    "normalize_advantages_by_rollout",
    "rollout_index_context",
    "rollout_index_of",
    "rollout_token_totals",
    "rows_per_rollout_metrics",
)

PER_ROLLOUT_MEAN_LOSS_MODE = "per_rollout_mean"
"""The ``actor.policy_loss.loss_mode`` name the PPO loss is registered under in verl."""

CISPO_PER_ROLLOUT_MEAN_LOSS_MODE = "cispo_per_rollout_mean"
"""The loss mode of :func:`compute_policy_loss_cispo_per_rollout_mean` (the name Agent Lightning 1.0.2 uses)."""

GEO_MEAN_PER_ROLLOUT_LOSS_MODE = "geo_mean_per_rollout"
"""The loss mode of :func:`compute_policy_loss_geo_mean_per_rollout`."""

GSPO_PER_ROLLOUT_LOSS_MODE = "gspo_per_rollout"
"""The loss mode of :func:`compute_policy_loss_gspo_per_rollout`."""

RolloutDivisor = Literal["rollouts", "rows"]
"""What :func:`normalize_advantages_by_rollout` multiplies a rollout's token count by."""

ROLLOUT_DIVISORS: tuple[RolloutDivisor, ...] = ("rollouts", "rows")
"""The accepted values of ``algorithm.per_rollout_divisor``; ``"rollouts"`` is the default."""

RolloutLossAggMode = Literal[
    "seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"
]
"""verl's ``loss_agg_mode`` values, read with rollouts as the sequences (see
:func:`normalize_advantages_by_rollout`)."""

ROLLOUT_LOSS_AGG_MODES: tuple[RolloutLossAggMode, ...] = get_args(RolloutLossAggMode)

CodeArray = npt.NDArray[np.int64] | torch.Tensor
"""Rollout codes, one int64 per row."""

LOG_RATIO_CLAMP = 20.0
"""log(pi/pi_old) is clamped to [-20, 20] before exp, as in verl, so the ratio never overflows."""

GSPO_LOG_RATIO_MAX = 10.0
"""GSPO's log sequence ratio is clamped above at 10, as in verl's ``gspo``."""

_ROLLOUT_INDEX: ContextVar[torch.Tensor | None] = ContextVar("agl_rollout_index", default=None)


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


def _validated_divisor(divisor: str) -> RolloutDivisor:
    if divisor not in ROLLOUT_DIVISORS:
        raise ValueError(
            f"Unsupported per_rollout_divisor: {divisor!r}. Supported: {list(ROLLOUT_DIVISORS)} "
            "('rollouts': one rollout, one vote; 'rows': Agent Lightning 1.0.2's divisor)"
        )
    return divisor  # pyright: ignore[reportReturnType]  (checked against the Literal's values)


def _step_count(
    divisor: RolloutDivisor,
    codes: torch.Tensor,
    num_trained_rows: int | None,
    num_trained_rollouts: int | None,
) -> int:
    """The whole step's count the divisor multiplies: its trained rows or its distinct rollouts."""
    if divisor == "rows":
        if num_trained_rows is None:
            raise ValueError("divisor='rows' needs num_trained_rows, the step's trained rows (len(batch))")
        count, name = num_trained_rows, "num_trained_rows"
    elif num_trained_rollouts is None:
        count, name = int(torch.unique(codes).numel()), "the number of rollouts"
    else:
        count, name = num_trained_rollouts, "num_trained_rollouts"
    if count <= 0 and codes.numel():
        raise ValueError(f"{name} must be positive, got {count}; pass the whole step's count")
    return count


def rollout_token_totals(
    response_mask: torch.Tensor, rollout_ids: IdArray, *, rollout_codes: CodeArray | None = None
) -> torch.Tensor:
    """Each row's rollout's trained tokens, summed over all the rollout's rows.

    ``response_mask`` (N, T), ``rollout_ids`` (N,) -> (N,) int64; ``rollout_codes`` as in
    :func:`normalize_advantages_by_rollout`. Rows of one rollout get the same total.
    """
    n_rows = response_mask.shape[0]
    if len(rollout_ids) != n_rows:
        raise ValueError(f"rollout_ids length ({len(rollout_ids)}) must match response_mask rows ({n_rows})")
    return _token_totals(response_mask, _codes(rollout_ids, rollout_codes, n_rows, response_mask.device))


def _token_totals(response_mask: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    row_tokens = response_mask.sum(-1, dtype=torch.int64)
    totals = torch.zeros(codes.shape[0], dtype=torch.int64, device=response_mask.device)
    return totals.index_add_(0, codes, row_tokens)[codes]


def normalize_advantages_by_rollout(
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_ids: IdArray,
    *,
    divisor: RolloutDivisor = "rollouts",
    num_trained_rows: int | None = None,
    num_trained_rollouts: int | None = None,
    rollout_codes: CodeArray | None = None,
    loss_agg_mode: RolloutLossAggMode = "seq-mean-token-mean",
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Divide each row's advantages by (trained tokens of its rollout x the step's count).

    That is the default ``loss_agg_mode``; a loss summing the tokens of the result then aggregates
    as verl's ``loss_agg_mode`` does with each rollout as one sequence:

    - ``"seq-mean-token-mean"`` and ``"token-mean"``: tokens of the rollout x count (mean over
      rollouts of each rollout's token mean);
    - ``"seq-mean-token-sum"``: count (mean over rollouts of each rollout's token sum);
    - ``"seq-mean-token-sum-norm"``: count x ``loss_scale_factor`` (Dr. GRPO's constant, required);
    - ``"token-sum"``: 1.

    ``advantages``, ``response_mask`` (N, T); ``rollout_ids`` (N,) -> (N, T) in the advantages' dtype.
    The count is the step's whole trained batch (not a mini-batch), so mini-batch updates sum to the
    step's loss:

    - ``divisor="rollouts"`` (the default): its distinct rollouts, ``num_trained_rollouts`` or, when None, the
      distinct ids given (the call then gets the whole step's batch). A masked-sum loss is then the
      mean over rollouts of each rollout's token mean, however many rows a rollout spans.
    - ``divisor="rows"``: ``num_trained_rows``, Agent Lightning 1.0.2's divisor. A rollout split into
      k rows then weighs as 1/k of a one-row rollout would (the reference's issue 593).

    The divisor is clamped at 1. ``rollout_codes`` (N,) int64, optional: the rollouts already numbered
    (``RolloutLevelAdvantage.layout.rollout_of_row``), trusted to match ``rollout_ids`` (only dtype,
    shape and range are checked) so the ids are not grouped again.
    """
    mode = _validated_divisor(divisor)
    n_rows = advantages.shape[0]
    if len(rollout_ids) != n_rows:
        raise ValueError(f"rollout_ids length ({len(rollout_ids)}) must match advantages rows ({n_rows})")
    if response_mask.shape != advantages.shape:
        raise ValueError(
            f"response_mask {tuple(response_mask.shape)} must have the shape of advantages "
            f"{tuple(advantages.shape)}"
        )
    if loss_agg_mode not in ROLLOUT_LOSS_AGG_MODES:
        raise ValueError(
            f"Unsupported loss_agg_mode: {loss_agg_mode!r}. Supported: {list(ROLLOUT_LOSS_AGG_MODES)}"
        )
    codes = _codes(rollout_ids, rollout_codes, n_rows, advantages.device)
    if loss_agg_mode == "token-sum":
        return advantages.clone()
    count = _step_count(mode, codes, num_trained_rows, num_trained_rollouts)
    if loss_agg_mode in ("seq-mean-token-mean", "token-mean"):
        tokens = _token_totals(response_mask, codes)
        return advantages / (tokens * count).clamp_min(1).to(advantages.dtype).unsqueeze(-1)
    scale = 1.0
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None or not loss_scale_factor > 0:
            raise ValueError(
                f"loss_agg_mode='seq-mean-token-sum-norm' needs loss_scale_factor > 0, got {loss_scale_factor!r} "
                "(Dr. GRPO's constant, e.g. the max response length)"
            )
        scale = float(loss_scale_factor)
    return advantages / (max(count, 1) * scale)


def rollout_index_of(rollout_ids: IdArray) -> torch.Tensor:
    """``rollout_ids`` (N,) -> (N,) int64 rollout numbers 0..R-1 in order of first appearance: the
    ``rollout_index`` :func:`compute_policy_loss_gspo_per_rollout` groups rows by."""
    return torch.as_tensor(factorize(rollout_ids, name="rollout_ids").codes)


def rows_per_rollout_metrics(rollout_ids: IdArray) -> dict[str, float]:
    """``training/rows_per_rollout_mean``: trained rows / distinct rollouts (0.0 for no rows)."""
    n_rollouts = factorize(rollout_ids, name="rollout_ids").n_unique
    return {"training/rows_per_rollout_mean": len(rollout_ids) / n_rollouts if n_rollouts else 0.0}


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


def _masked_fraction(condition: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (condition & mask).sum(dtype=torch.float32)


def _clip_metrics(clipped: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """``actor/pg_clipfrac`` (share of ``clipped``), ``actor/ppo_kl``, ``actor/pg_clipfrac_lower`` = 0.0:
    masked means as verl's ``masked_mean`` computes them, read with one device sync."""
    with torch.no_grad():
        denominator = mask.sum(dtype=torch.float32) + 1e-8
        kl_sum = torch.where(mask, -log_ratio, 0.0).sum(dtype=torch.float32)
        stats = torch.stack((_masked_fraction(clipped, mask), kl_sum)) / denominator
        clipfrac, ppo_kl = stats.tolist()
    return {"actor/pg_clipfrac": clipfrac, "actor/ppo_kl": ppo_kl, "actor/pg_clipfrac_lower": 0.0}


def compute_policy_loss_cispo_per_rollout_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """CISPO: ``-sg(clip(ratio, 1 - low, 1 + high)) * A * log_prob`` summed over trained tokens x dp_size.

    All tensors (B, T); ``advantages`` normalised by :func:`normalize_advantages_by_rollout`. The
    clipped ratio is detached, so a clipped token keeps its policy-gradient signal, scaled by the
    bound. log(ratio) is clamped to ±20 as in verl. ``config``, ``loss_agg_mode`` (ignored) and the
    metrics as in :func:`compute_policy_loss_per_rollout_mean`; ``actor/pg_clipfrac`` is the share
    of tokens whose ratio was clipped, ``actor/pg_clipfrac_lower`` is 0.0.
    """
    params = PolicyLossConfig.from_actor_config(config)
    mask = response_mask.bool()
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1.0 - params.low, 1.0 + params.high)
    token_loss = -clipped_ratio.detach() * advantages * log_prob
    if rollout_is_weights is not None:
        token_loss = token_loss * rollout_is_weights
    loss = torch.where(mask, token_loss, 0.0).sum() * params.dp_size
    return loss, _clip_metrics(ratio != clipped_ratio, log_ratio, mask)


@contextmanager
def rollout_index_context(rollout_index: torch.Tensor | None) -> Generator[None]:
    """Make ``rollout_index`` (B,) the one :func:`compute_policy_loss_gspo_per_rollout` reads when it
    is called without one, for the duration of the block.

    verl calls a registered policy loss with a fixed set of keywords that carries no per-row field
    beyond the tensors it needs itself, so this context is how a batch's rollout index reaches the
    loss (``agl_algos.verl.RolloutIndexLoss`` opens it around verl's ``ppo_loss``).
    """
    token = _ROLLOUT_INDEX.set(rollout_index)
    try:
        yield
    finally:
        _ROLLOUT_INDEX.reset(token)


def _rollout_index(rollout_index: torch.Tensor | None, n_rows: int, device: torch.device) -> torch.Tensor:
    """Codes (B,) in [0, K): rows with the same value of the given or context index share a rollout."""
    index = _ROLLOUT_INDEX.get() if rollout_index is None else rollout_index
    if index is None:
        raise ValueError(
            "gspo_per_rollout needs each row's rollout index and got none: pass rollout_index=, or, under "
            "verl, put batch['rollout_index'] (N,) int64 into the actor's batch and wrap the actor's loss "
            "function in agl_algos.verl.RolloutIndexLoss"
        )
    index = torch.as_tensor(index, device=device)
    if index.shape != (n_rows,) or index.dtype.is_floating_point or index.dtype == torch.bool:
        raise ValueError(
            f"rollout_index must be an integer tensor of shape ({n_rows},), got {index.dtype} "
            f"{tuple(index.shape)}; pass one rollout number per row"
        )
    return torch.unique(index, return_inverse=True)[1]


def compute_policy_loss_gspo_per_rollout(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    rollout_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """GSPO with one sequence ratio per rollout, summed over trained tokens x dp_size.

    All tensors (B, T); ``rollout_index`` (B,) integers, equal for rows of one rollout (when None,
    the one set by :func:`rollout_index_context`). Per rollout r, ``log s_r`` is the mean of
    ``log_prob - old_log_prob`` over all trained tokens of all its rows in this call; each token's
    ratio is ``exp(min(sg(log s_r) + log_prob - sg(log_prob), 10))``, so its value is s_r and its
    gradient ``s_r * grad log_prob``, and the token loss is ``max(-A * s, -A * clip(s, 1 - low, 1 +
    high))``, as verl's ``gspo`` does per row. With rollout-normalised ``advantages`` the sum is
    GSPO's mean over sequences of each sequence's token mean, with rollouts as the sequences.
    A rollout split across calls (micro-batches, data-parallel ranks) gets its ratio from the rows
    each call holds. ``config``, ``loss_agg_mode`` (ignored) and the metrics as in
    :func:`compute_policy_loss_per_rollout_mean`, ``actor/pg_clipfrac_lower`` being 0.0.
    """
    params = PolicyLossConfig.from_actor_config(config)
    mask = response_mask.bool()
    codes = _rollout_index(rollout_index, log_prob.shape[0], log_prob.device)
    log_ratio = torch.where(mask, log_prob - old_log_prob, 0.0)
    rollout_sums = torch.zeros(codes.shape[0], dtype=log_ratio.dtype, device=log_ratio.device)
    rollout_sums.index_add_(0, codes, log_ratio.sum(-1))
    rollout_tokens = torch.zeros_like(rollout_sums).index_add_(0, codes, mask.sum(-1).to(log_ratio.dtype))
    seq_log_ratio = (rollout_sums / rollout_tokens.clamp_min(1.0))[codes].detach()
    log_seq_ratio = log_prob - log_prob.detach() + seq_log_ratio.unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=GSPO_LOG_RATIO_MAX))
    unclipped = -advantages * seq_ratio
    clipped = -advantages * torch.clamp(seq_ratio, 1.0 - params.low, 1.0 + params.high)
    token_loss = torch.maximum(unclipped, clipped)
    if rollout_is_weights is not None:
        token_loss = token_loss * rollout_is_weights
    loss = torch.where(mask, token_loss, 0.0).sum() * params.dp_size
    return loss, _clip_metrics(clipped > unclipped, log_ratio, mask)


def compute_policy_loss_geo_mean_per_rollout(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    rollout_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """GMPO (verl's ``geo_mean``, arXiv:2507.20673) with one geometric-mean ratio per rollout.

    Tensors and ``rollout_index`` as in :func:`compute_policy_loss_gspo_per_rollout`. Each token's
    log-ratio is clipped to ``[-low, high]`` on the side its advantage's sign makes pessimistic, as
    verl's ``geo_mean`` does; per rollout r, ``ratio_r = exp(mean of those over all trained tokens of
    all its rows)`` and the loss is ``-sum_r ratio_r * (sum of r's trained advantages)`` x dp_size,
    with ``rollout_is_weights`` entering as their geometric mean per rollout. With rollout-normalised
    advantages that is the mean over rollouts of ``-A_r * ratio_r`` (verl averages rows instead).
    ``loss_agg_mode`` is ignored; metrics as verl's ``geo_mean``.
    """
    params = PolicyLossConfig.from_actor_config(config)
    mask = response_mask.bool()
    codes = _rollout_index(rollout_index, log_prob.shape[0], log_prob.device)
    log_ratio = torch.where(mask, log_prob - old_log_prob, 0.0)
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -params.low, params.high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)

    def per_rollout(values: torch.Tensor) -> torch.Tensor:
        totals = torch.zeros(codes.shape[0], dtype=values.dtype, device=values.device)
        return totals.index_add_(0, codes, torch.where(mask, values, 0.0).sum(-1))

    tokens = per_rollout(torch.ones_like(log_ratio)).clamp_min(1.0)
    ratio = torch.exp(per_rollout(pessimistic) / tokens)
    losses = -per_rollout(advantages) * ratio
    if rollout_is_weights is not None:
        losses = losses * torch.exp(per_rollout(torch.log(rollout_is_weights + 1e-10)) / tokens)
    loss = losses.sum() * params.dp_size
    with torch.no_grad():
        clipped = log_ratio != clamped
        lower = _masked_fraction(clipped & (advantages < 0), mask) / (mask.sum(dtype=torch.float32) + 1e-8)
    metrics = _clip_metrics(clipped & (advantages > 0), log_ratio, mask)
    metrics["actor/pg_clipfrac_lower"] = float(lower)
    return loss, metrics
