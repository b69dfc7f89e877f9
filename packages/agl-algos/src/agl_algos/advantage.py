"""Rollout-level GRPO advantage: one advantage per rollout, shared by all its rows.

An agentic rollout can become several training rows (one per non-continuing LLM turn). Row-level GRPO
would count such a rollout several times in its group's statistics. Here each rollout is represented once
(its first row), GRPO runs over the representatives, and the rollout's scalar is broadcast back onto
every trained token of all its rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from agl_algos._ids import IdArray, as_id_array, factorize, plain
from agl_algos.errors import RolloutConsistencyError

__all__ = (
    "GRPO_EPSILON",
    "RolloutLayout",
    "RolloutLevelAdvantage",
    "broadcast_rollout_scalars",
    "compute_rollout_level_advantage",
    "extract_rollout_scalars",
    "grpo_outcome_advantage",
    "rollout_layout",
)

GRPO_EPSILON = 1e-6
"""The epsilon verl's ``compute_grpo_outcome_advantage`` adds to the group std."""

_METRIC_PREFIX = "training/rollout_level_advantage/"


@dataclass(frozen=True, slots=True)
class RolloutLayout:
    """Which rows belong to which rollout, rollouts numbered in order of first appearance.

    ``rollout_of_row`` (N,) int64; ``representatives`` (R,) int64, the first row of each rollout
    (ascending); ``rollout_ids`` (R,) the ids; ``rows_per_rollout`` (R,) int64.
    """

    rollout_of_row: npt.NDArray[np.int64]
    representatives: npt.NDArray[np.int64]
    rollout_ids: npt.NDArray[Any]
    rows_per_rollout: npt.NDArray[np.int64]

    def metrics(self) -> dict[str, int]:
        """``training/rollout_level_advantage/{n_rows,n_rollouts,n_multi_row_rollouts,max_rows_per_rollout}``."""
        counts = self.rows_per_rollout
        return {
            f"{_METRIC_PREFIX}n_rows": int(self.rollout_of_row.shape[0]),
            f"{_METRIC_PREFIX}n_rollouts": int(counts.shape[0]),
            f"{_METRIC_PREFIX}n_multi_row_rollouts": int((counts > 1).sum()),
            f"{_METRIC_PREFIX}max_rows_per_rollout": int(counts.max()) if counts.shape[0] else 0,
        }


@dataclass(frozen=True, slots=True)
class RolloutLevelAdvantage:
    """Output of :func:`compute_rollout_level_advantage`: (N, T) float32 ``advantages`` and ``returns``
    (equal for GRPO, as in verl, but distinct tensors) and the row/rollout layout with its counts."""

    advantages: torch.Tensor
    returns: torch.Tensor
    layout: RolloutLayout

    @property
    def n_rows(self) -> int:
        return int(self.layout.rollout_of_row.shape[0])

    @property
    def n_rollouts(self) -> int:
        return int(self.layout.rows_per_rollout.shape[0])

    @property
    def n_multi_row_rollouts(self) -> int:
        return int((self.layout.rows_per_rollout > 1).sum())

    def metrics(self) -> dict[str, int]:
        return self.layout.metrics()


def _rows_of(layout: RolloutLayout, rollout: int) -> list[int]:
    return np.flatnonzero(layout.rollout_of_row == rollout).tolist()


def rollout_layout(rollout_ids: IdArray, uids: IdArray, row_rewards: torch.Tensor) -> RolloutLayout:
    """Group rows by rollout and check that all rows of a rollout share one uid and one reward sum.

    ``rollout_ids``, ``uids`` (N,); ``row_rewards`` (N,) the per-row reward sums, compared in float32
    with ``torch.isclose`` defaults against the rollout's first row. Raises
    :class:`RolloutConsistencyError` naming the rollout, its rows and the disagreeing values.
    """
    rollouts = factorize(rollout_ids, name="rollout_ids")
    groups = factorize(uids, name="uids")
    n_rows = rollouts.codes.shape[0]
    if groups.codes.shape[0] != n_rows or row_rewards.shape != (n_rows,):
        raise ValueError(
            f"rollout_ids ({n_rows}), uids ({groups.codes.shape[0]}) and row rewards "
            f"({tuple(row_rewards.shape)}) must all have one entry per row"
        )
    layout = RolloutLayout(
        rollout_of_row=rollouts.codes,
        representatives=rollouts.first_rows,
        rollout_ids=rollouts.values,
        rows_per_rollout=np.bincount(rollouts.codes, minlength=rollouts.n_unique).astype(np.int64),
    )
    rep_of_row = layout.representatives[layout.rollout_of_row]
    uid_bad = np.flatnonzero(groups.codes != groups.codes[rep_of_row])
    if uid_bad.shape[0]:
        rollout = int(layout.rollout_of_row[uid_bad[0]])
        rows = _rows_of(layout, rollout)
        raise RolloutConsistencyError(
            f"rollout_id={plain(layout.rollout_ids[rollout])!r}: rows {rows} carry several uid values "
            f"{sorted({str(v) for v in as_id_array(uids, name='uids')[rows]})}; all rows of one rollout must "
            "belong to one GRPO group (give every row of a rollout its sample's data_id)"
        )
    rewards = row_rewards.detach().float()
    rep_index = torch.as_tensor(rep_of_row, device=rewards.device)
    reward_bad = torch.nonzero(~torch.isclose(rewards, rewards[rep_index])).flatten()
    if reward_bad.numel():
        rollout = int(layout.rollout_of_row[int(reward_bad[0])])
        rows = _rows_of(layout, rollout)
        raise RolloutConsistencyError(
            f"rollout_id={plain(layout.rollout_ids[rollout])!r}: rows {rows} have reward sums "
            f"{rewards[rows].tolist()}; all rows of one rollout must share its scalar reward "
            "(put the rollout's final reward on every row's last response token)"
        )
    return layout


def grpo_outcome_advantage(
    scores: torch.Tensor,
    group_ids: IdArray,
    *,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = GRPO_EPSILON,
) -> torch.Tensor:
    """GRPO outcome advantage of one scalar score per sample, as verl's GRPO estimator defines it.

    ``scores`` (R,), ``group_ids`` (R,) -> (R,) float32. ``A = (s - mean_g) / (std_g + epsilon)`` with the
    unbiased std, or ``A = s - mean_g`` when ``norm_adv_by_std_in_grpo`` is False (Dr.GRPO,
    arXiv:2503.20783); a group of one uses mean 0 and std 1. Group statistics are computed in float64,
    so a group of equal scores gets exactly 0 (verl's float32 mean can leave a residue that the
    division by ``std + 1e-6`` inflates).
    """
    groups = factorize(group_ids, name="group_ids")
    if groups.codes.shape[0] != scores.shape[0] or scores.dim() != 1:
        raise ValueError(f"scores must have shape ({groups.codes.shape[0]},), got {tuple(scores.shape)}")
    values = scores.detach().to(torch.float64)
    codes = torch.as_tensor(groups.codes, device=values.device)
    counts = torch.bincount(codes, minlength=groups.n_unique).to(torch.float64)
    mean = torch.zeros_like(counts).index_add_(0, codes, values) / counts
    centered = values - mean[codes]
    square_sum = torch.zeros_like(counts).index_add_(0, codes, centered * centered)
    single = counts == 1
    std = torch.where(single, 1.0, torch.sqrt(square_sum / torch.where(single, 1.0, counts - 1)))
    mean = torch.where(single, 0.0, mean)
    advantage = values - mean[codes]
    if norm_adv_by_std_in_grpo:
        advantage = advantage / (std[codes] + epsilon)
    return advantage.to(torch.float32)


def broadcast_rollout_scalars(
    scalars: torch.Tensor, rollout_of_row: npt.NDArray[np.int64], response_mask: torch.Tensor
) -> torch.Tensor:
    """Spread one value per rollout onto its rows' trained tokens.

    ``scalars`` (R,), ``rollout_of_row`` (N,) codes into ``scalars``, ``response_mask`` (N, T)
    -> (N, T) float32: ``out[i, t] = scalars[rollout_of_row[i]] * response_mask[i, t]``.
    """
    index = torch.as_tensor(rollout_of_row, device=response_mask.device)
    per_row = scalars.detach().to(device=response_mask.device, dtype=torch.float32)[index]
    return per_row.unsqueeze(-1) * response_mask.to(torch.float32)


def extract_rollout_scalars(
    values: torch.Tensor, response_mask: torch.Tensor, rollout_ids: IdArray
) -> torch.Tensor:
    """Read the one value an outcome estimator gave each representative row.

    ``values``, ``response_mask`` (R, T), ``rollout_ids`` (R,) -> (R,) float32. Raises
    :class:`RolloutConsistencyError` for a row without trained tokens, or whose trained tokens do not
    all hold the same value (a token-level estimator such as GAE cannot be used at rollout level).
    """
    ids = as_id_array(rollout_ids, name="rollout_ids")
    mask = response_mask.bool()
    counts = mask.sum(-1)
    empty = torch.nonzero(counts == 0).flatten()
    if empty.numel():
        raise RolloutConsistencyError(
            f"rollout_id={plain(ids[int(empty[0])])!r} has no trained token on its representative row, so no "
            "advantage can be read from it; drop rollouts with empty responses before the advantage"
        )
    first = torch.gather(values.detach().float(), 1, mask.to(torch.int64).argmax(-1, keepdim=True))
    close = torch.isclose(values.detach().float(), first) | ~mask
    varying = torch.nonzero(~close.all(-1)).flatten()
    if varying.numel():
        raise RolloutConsistencyError(
            f"rollout_id={plain(ids[int(varying[0])])!r} got token values that vary along the response; "
            "rollout-level advantage needs an outcome estimator (one scalar per response, e.g. grpo, "
            "rloo, reinforce_plus_plus), or set algorithm.enable_rollout_level_advantage=false"
        )
    return first.squeeze(-1)


def compute_rollout_level_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_ids: IdArray,
    uids: IdArray,
    *,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = GRPO_EPSILON,
) -> RolloutLevelAdvantage:
    """GRPO over one representative row per rollout, broadcast onto all rows of the rollout.

    ``token_level_rewards``, ``response_mask`` (N, T); ``rollout_ids``, ``uids`` (N,), the uid being the
    GRPO group key (the sample's ``data_id``). Each rollout's reward is its first row's reward sum
    (all rows must agree, see :func:`rollout_layout`). Returns (N, T) float32 advantages and returns,
    zero on untrained tokens; the inputs are not modified.
    """
    if token_level_rewards.dim() != 2 or response_mask.shape != token_level_rewards.shape:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both have shape (rows, response_length)"
        )
    row_rewards = token_level_rewards.detach().float().sum(-1)
    layout = rollout_layout(rollout_ids, uids, row_rewards)
    representatives = torch.as_tensor(layout.representatives, device=row_rewards.device)
    rep_uids = as_id_array(uids, name="uids")[layout.representatives]
    scalars = grpo_outcome_advantage(
        row_rewards[representatives],
        rep_uids,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        epsilon=epsilon,
    )
    advantages = broadcast_rollout_scalars(scalars, layout.rollout_of_row, response_mask)
    return RolloutLevelAdvantage(advantages=advantages, returns=advantages.clone(), layout=layout)
