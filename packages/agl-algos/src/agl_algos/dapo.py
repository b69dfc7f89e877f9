"""DAPO's reward-side pieces (Yu et al. 2025, arXiv:2503.14476) for rollout-level rewards.

- Overlong reward shaping: a response longer than ``max_response_length - overlong_buffer.len`` loses
  reward linearly, ``penalty_factor`` at the full length, as verl's ``dapo`` reward manager computes it;
  here the length is a rollout's total response tokens over all its rows.
- Dynamic sampling: GRPO groups whose rewards are all equal carry no advantage; they are filtered out
  before the update (and the trainer may generate more groups to refill the batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from agl_algos._ids import IdArray, factorize
from agl_algos.config import _read  # pyright: ignore[reportPrivateUsage]

__all__ = (
    "DYNAMIC_SAMPLING_METRIC_PREFIX",
    "GroupFilter",
    "OverlongBuffer",
    "filter_zero_variance_groups",
    "overlong_reward_penalty",
)

DYNAMIC_SAMPLING_METRIC_PREFIX = "training/dynamic_sampling/"


@dataclass(frozen=True, slots=True)
class OverlongBuffer:
    """verl's ``overlong_buffer`` (``len``, ``penalty_factor``) and the length it is measured against.

    ``buffer_len`` > 0 tokens, at most ``max_response_length``; ``penalty_factor`` >= 0, the reward lost
    at exactly ``max_response_length``. Invalid values raise ``ValueError`` naming the key.
    """

    buffer_len: int
    penalty_factor: float
    max_response_length: int

    def __post_init__(self) -> None:
        if type(self.buffer_len) is not int or self.buffer_len <= 0:
            raise ValueError(
                f"overlong_buffer.len must be a positive integer, got {self.buffer_len!r}; "
                "to switch the penalty off, set overlong_buffer.enable=false"
            )
        if type(self.max_response_length) is not int or self.max_response_length < self.buffer_len:
            raise ValueError(
                f"max_response_length ({self.max_response_length!r}) must be an integer >= overlong_buffer.len "
                f"({self.buffer_len}); lower overlong_buffer.len"
            )
        factor = self.penalty_factor
        if not isinstance(factor, int | float) or not math.isfinite(factor) or factor < 0:  # pyright: ignore[reportUnnecessaryIsInstance]
            raise ValueError(f"overlong_buffer.penalty_factor must be a finite number >= 0, got {factor!r}")

    @classmethod
    def from_config(cls, overlong_buffer: Any, max_response_length: int) -> OverlongBuffer:
        """From verl's ``overlong_buffer`` config (a mapping or an object with ``len``, ``penalty_factor``)."""
        length, factor = _read(overlong_buffer, "len", None), _read(overlong_buffer, "penalty_factor", None)
        if length is None or factor is None:
            raise ValueError(
                f"overlong_buffer needs len and penalty_factor, got len={length!r}, penalty_factor={factor!r}; "
                "e.g. overlong_buffer.len=512 overlong_buffer.penalty_factor=1.0"
            )
        return cls(buffer_len=length, penalty_factor=factor, max_response_length=max_response_length)


def overlong_reward_penalty(response_lengths: torch.Tensor, buffer: OverlongBuffer) -> torch.Tensor:
    """DAPO's soft overlong penalty, ``min(-(L - (max_len - buffer_len)) / buffer_len * factor, 0)``.

    ``response_lengths`` (R,) one total per rollout (e.g. :func:`agl_algos.rollout_token_totals`) ->
    (R,) float32 (computed in float64), 0 up to ``max_response_length - buffer_len`` tokens, ``-penalty_factor`` at
    ``max_response_length``. As in verl the penalty is not floored: a rollout whose rows add up to more
    than ``max_response_length`` loses more than ``penalty_factor``. Add it to the rollout's reward.
    """
    lengths = response_lengths.detach().to(torch.float64)
    expected = buffer.max_response_length - buffer.buffer_len
    penalty = -(lengths - expected) / buffer.buffer_len * buffer.penalty_factor
    return penalty.clamp(max=0.0).to(torch.float32)


@dataclass(frozen=True, slots=True)
class GroupFilter:
    """Output of :func:`filter_zero_variance_groups`: ``kept`` (K,) int64 ascending item indices, and
    how many groups were kept and filtered."""

    kept: npt.NDArray[np.int64]
    n_groups_kept: int
    n_groups_filtered: int

    def metrics(self) -> dict[str, int]:
        """``training/dynamic_sampling/groups_kept`` and ``training/dynamic_sampling/groups_filtered``."""
        return {
            f"{DYNAMIC_SAMPLING_METRIC_PREFIX}groups_kept": self.n_groups_kept,
            f"{DYNAMIC_SAMPLING_METRIC_PREFIX}groups_filtered": self.n_groups_filtered,
        }


def filter_zero_variance_groups(
    rewards: torch.Tensor | npt.NDArray[np.floating] | list[float],
    group_ids: IdArray,
    *,
    rollout_ids: IdArray | None = None,
) -> GroupFilter:
    """DAPO's dynamic-sampling filter: keep the items of groups whose rewards are not all equal.

    ``rewards``, ``group_ids`` (M,): one entry per rollout, or per row with ``rollout_ids`` (M,) naming
    each row's rollout (rows of a rollout carry its reward). A group of one rollout is kept, as in DAPO
    and verl (no variance can be estimated from it). "Equal" is exact equality of the float64 values;
    verl's ``np.std(values) == 0`` keeps, e.g., seven rewards of 0.7 (std 1.1e-16).
    """
    groups = factorize(group_ids, name="group_ids")
    values = torch.as_tensor(rewards).detach().to(torch.float64).cpu().numpy()
    if values.shape != groups.codes.shape:
        raise ValueError(
            f"rewards must have shape {groups.codes.shape} (one per group id), got {values.shape}"
        )
    n_groups = groups.n_unique
    high = np.full(n_groups, -np.inf)
    low = np.full(n_groups, np.inf)
    np.maximum.at(high, groups.codes, values)
    np.minimum.at(low, groups.codes, values)
    members = groups.codes if rollout_ids is None else _group_of_rollouts(groups.codes, rollout_ids)
    keep_group = (high > low) | (np.bincount(members, minlength=n_groups) == 1)
    kept = np.flatnonzero(keep_group[groups.codes]).astype(np.int64)
    n_kept = int(keep_group.sum())
    return GroupFilter(kept=kept, n_groups_kept=n_kept, n_groups_filtered=n_groups - n_kept)


def _group_of_rollouts(group_codes: npt.NDArray[np.int64], rollout_ids: IdArray) -> npt.NDArray[np.int64]:
    """The group code of each distinct rollout (its first row's), so groups count rollouts, not rows."""
    rollouts = factorize(rollout_ids, name="rollout_ids")
    if rollouts.codes.shape != group_codes.shape:
        raise ValueError(
            f"rollout_ids must have one entry per reward ({group_codes.shape[0]}), got {rollouts.codes.shape[0]}"
        )
    return group_codes[rollouts.first_rows]
