"""GRPO group bookkeeping: zero-advantage groups, the mini-batch cut that drops them first, metrics.

A GRPO group (rows sharing a uid, i.e. one train sample's ``data_id``) of two or more rollouts whose rewards
are all equal has zero advantage everywhere and yields no policy gradient. When a step's batch must be cut
to a multiple of the mini-batch size, rows of such groups are the cheapest to lose, so they are dropped
first. As in the reference, a group holding a single rollout (one row, or several rows of one rollout,
e.g. with ``rollout.n = 1``) also counts as same-reward, both as a drop candidate and in
``n_zero_adv_groups``, although GRPO gives it ``s / (1 + 1e-6)``, not 0; kept for compatibility.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from agl_algos._ids import IdArray, factorize

__all__ = (
    "RowSelection",
    "grpo_group_metrics",
    "mini_batch_keep_count",
    "row_rewards_from_scores",
    "same_reward_group_rows",
    "select_rows_to_keep",
    "zero_advantage_drop_order",
)

Rewards = torch.Tensor | npt.NDArray[np.floating] | Sequence[float]
"""One reward per row (the row's ``token_level_scores`` sum)."""

Generator = np.random.Generator | torch.Generator


def row_rewards_from_scores(token_level_scores: torch.Tensor) -> torch.Tensor:
    """Row reward sums of (N, T) token scores -> (N,) float32 (summed in float32, never bf16)."""
    return token_level_scores.detach().float().sum(-1)


def _as_rewards(row_rewards: Rewards, n_rows: int) -> npt.NDArray[np.float32]:
    if isinstance(row_rewards, torch.Tensor):
        values = row_rewards.detach().float().cpu().numpy()
    else:
        values = np.asarray(row_rewards, dtype=np.float32)
    if values.shape != (n_rows,):
        raise ValueError(f"row_rewards must have shape ({n_rows},) (one per uid), got {values.shape}")
    return values


def same_reward_group_rows(uids: IdArray, row_rewards: Rewards) -> npt.NDArray[np.int64]:
    """Ascending row indices of every group whose rewards are all close to the group's first row.

    ``uids``, ``row_rewards`` (N,). Closeness is ``np.isclose`` with torch's ``allclose`` defaults
    (rtol 1e-5, atol 1e-8) against the first row; a group of one row qualifies.
    """
    groups = factorize(uids, name="uids")
    rewards = _as_rewards(row_rewards, groups.codes.shape[0])
    first = rewards[groups.first_rows][groups.codes]
    differs = ~np.isclose(rewards, first, rtol=1e-5, atol=1e-8)
    group_differs = np.bincount(groups.codes[differs], minlength=groups.n_unique) > 0
    return np.flatnonzero(~group_differs[groups.codes]).astype(np.int64)


def _permutation(n: int, generator: Generator) -> npt.NDArray[np.int64]:
    if isinstance(generator, torch.Generator):
        return torch.randperm(n, generator=generator).numpy().astype(np.int64)
    return generator.permutation(n).astype(np.int64)


def zero_advantage_drop_order(
    uids: IdArray, row_rewards: Rewards, generator: Generator
) -> npt.NDArray[np.int64]:
    """All N row indices in the order they should be dropped: same-reward rows first, then the rest,
    each part shuffled with ``generator``."""
    candidates = same_reward_group_rows(uids, row_rewards)
    n_rows = len(uids)
    others = np.setdiff1d(np.arange(n_rows, dtype=np.int64), candidates, assume_unique=True)
    return np.concatenate(
        (
            candidates[_permutation(candidates.shape[0], generator)],
            others[_permutation(others.shape[0], generator)],
        )
    )


@dataclass(frozen=True, slots=True)
class RowSelection:
    """Rows kept by :func:`select_rows_to_keep`: ``keep`` (n_keep,) int64 ascending, and what was dropped."""

    keep: npt.NDArray[np.int64]
    n_dropped_same_reward: int
    n_dropped_random: int

    def metrics(self) -> dict[str, int]:
        """``training/n_sample_dropped/same_reward``, ``.../random`` and ``training/n_sample_trained``."""
        return {
            "training/n_sample_dropped/same_reward": self.n_dropped_same_reward,
            "training/n_sample_dropped/random": self.n_dropped_random,
            "training/n_sample_trained": int(self.keep.shape[0]),
        }


def select_rows_to_keep(
    uids: IdArray, row_rewards: Rewards, n_keep: int, generator: Generator
) -> RowSelection:
    """Cut N rows to ``n_keep``, dropping rows of same-reward groups first, then uniformly at random.

    Rows are dropped individually (a group or a rollout may be split). The kept indices are ascending,
    so the batch order is preserved. ``n_keep >= N`` keeps everything.
    """
    n_rows = len(uids)
    if n_keep < 0:
        raise ValueError(f"n_keep must be >= 0, got {n_keep}")
    n_drop = max(n_rows - n_keep, 0)
    if n_drop == 0:
        return RowSelection(
            keep=np.arange(n_rows, dtype=np.int64), n_dropped_same_reward=0, n_dropped_random=0
        )
    n_candidates = same_reward_group_rows(uids, row_rewards).shape[0]
    dropped = zero_advantage_drop_order(uids, row_rewards, generator)[:n_drop]
    keep = np.setdiff1d(np.arange(n_rows, dtype=np.int64), dropped, assume_unique=True)
    n_same = min(n_drop, n_candidates)
    return RowSelection(keep=keep, n_dropped_same_reward=n_same, n_dropped_random=n_drop - n_same)


def mini_batch_keep_count(
    n_rows: int, mini_batch_rows: int, *, max_ppo_update_times: int | None = None
) -> int:
    """Rows a step can train on: the largest multiple of ``mini_batch_rows`` (``ppo_mini_batch_size x
    rollout.n``) not above ``n_rows``, capped at ``mini_batch_rows x max_ppo_update_times`` when set."""
    if mini_batch_rows <= 0:
        raise ValueError(
            f"mini_batch_rows must be positive, got {mini_batch_rows}; "
            "pass actor.ppo_mini_batch_size * rollout.n"
        )
    if max_ppo_update_times is not None and max_ppo_update_times <= 0:
        raise ValueError(
            f"max_ppo_update_times must be positive or None, got {max_ppo_update_times}; "
            "set agentlightning.max_ppo_update_times to null for no cap"
        )
    n_keep = n_rows // mini_batch_rows * mini_batch_rows
    if max_ppo_update_times is not None:
        n_keep = min(n_keep, mini_batch_rows * max_ppo_update_times)
    return n_keep


def grpo_group_metrics(uids: IdArray, row_rewards: Rewards) -> dict[str, int]:
    """``training/n_groups`` and ``training/n_zero_adv_groups`` (groups whose max - min reward is 0.0)."""
    groups = factorize(uids, name="uids")
    rewards = _as_rewards(row_rewards, groups.codes.shape[0])
    n_groups = groups.n_unique
    high = np.full(n_groups, -np.inf, dtype=np.float32)
    low = np.full(n_groups, np.inf, dtype=np.float32)
    np.maximum.at(high, groups.codes, rewards)
    np.minimum.at(low, groups.codes, rewards)
    return {"training/n_groups": n_groups, "training/n_zero_adv_groups": int((high - low == 0.0).sum())}
