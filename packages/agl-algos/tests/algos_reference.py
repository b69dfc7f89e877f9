"""Naive per-row loop implementations the vectorised code of agl_algos is checked against."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch


def normalize_by_rollout_loop(
    advantages: torch.Tensor, response_mask: torch.Tensor, rollout_ids: list[Any], num_trained_rows: int
) -> torch.Tensor:
    tokens: dict[Any, float] = defaultdict(float)
    for row, rid in enumerate(rollout_ids):
        tokens[rid] += float(response_mask[row].sum())
    out = advantages.clone()
    for row, rid in enumerate(rollout_ids):
        out[row] = advantages[row] / max(tokens[rid] * num_trained_rows, 1.0)
    return out


def grpo_loop(
    scores: list[float], groups: list[Any], norm: bool = True, epsilon: float = 1e-6
) -> list[float]:
    members: dict[Any, list[float]] = defaultdict(list)
    for score, group in zip(scores, groups, strict=True):
        members[group].append(score)
    out = []
    for score, group in zip(scores, groups, strict=True):
        values = members[group]
        if len(values) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        out.append((score - mean) / (std + epsilon) if norm else score - mean)
    return out


def rollout_level_loop(
    rewards: torch.Tensor, mask: torch.Tensor, rollout_ids: list[Any], uids: list[Any], norm: bool = True
) -> torch.Tensor:
    first_row: dict[Any, int] = {}
    for row, rid in enumerate(rollout_ids):
        first_row.setdefault(rid, row)
    reps = list(first_row.values())
    scalars = grpo_loop([float(rewards[r].sum()) for r in reps], [uids[r] for r in reps], norm)
    by_rollout = dict(zip(first_row, scalars, strict=True))
    out = torch.zeros(rewards.shape, dtype=torch.float32)
    for row, rid in enumerate(rollout_ids):
        for t in range(rewards.shape[1]):
            out[row, t] = by_rollout[rid] * float(mask[row, t])
    return out


def ppo_token_loss(old: float, new: float, adv: float, low: float, high: float, c: float) -> float:
    ratio = math.exp(max(min(new - old, 20.0), -20.0))
    clip_loss = max(-adv * ratio, -adv * min(max(ratio, 1 - low), 1 + high))
    return min(-adv * c, clip_loss) if adv < 0 else clip_loss


def cispo_token_loss(old: float, new: float, adv: float, low: float, high: float) -> float:
    """CISPO's token loss as Agent Lightning 1.0.2 and verl define it: -clip(ratio) * A * log_prob."""
    ratio = math.exp(max(min(new - old, 20.0), -20.0))
    return -min(max(ratio, 1 - low), 1 + high) * adv * new


def gspo_per_rollout_loop(
    old: torch.Tensor,
    new: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    rollout_index: list[int],
    low: float,
    high: float,
) -> tuple[float, torch.Tensor]:
    """GSPO with one ratio per rollout: the loss (token sum) and its gradient in log_prob, token by token.

    A token's ratio is s_r = exp(min(mean log-ratio of its rollout, 10)); its loss max(-A s, -A clip(s))
    has gradient -A s in log_prob unless the clipped term is strictly larger (then 0).
    """
    total: dict[int, float] = defaultdict(float)
    count: dict[int, int] = defaultdict(int)
    for row, rollout in enumerate(rollout_index):
        for t in range(mask.shape[1]):
            if mask[row, t]:
                total[rollout] += float(new[row, t] - old[row, t])
                count[rollout] += 1
    loss, grad = 0.0, torch.zeros(mask.shape, dtype=torch.float64)
    for row, rollout in enumerate(rollout_index):
        log_s = total[rollout] / max(count[rollout], 1)
        s = math.exp(min(log_s, 10.0))
        for t in range(mask.shape[1]):
            if mask[row, t]:
                a = float(adv[row, t])
                unclipped, clipped = -a * s, -a * min(max(s, 1 - low), 1 + high)
                loss += max(unclipped, clipped)
                grad[row, t] = 0.0 if clipped > unclipped or log_s > 10.0 else -a * s
    return loss, grad


def overlong_penalty_loop(length: int, buffer_len: int, factor: float, max_len: int) -> float:
    """verl's DAPO reward manager: min(-(L - (max_len - buffer_len)) / buffer_len * factor, 0)."""
    exceed = length - (max_len - buffer_len)
    return min(-exceed / buffer_len * factor, 0.0)


def zero_variance_filter_loop(rewards: list[float], groups: list[Any], rollouts: list[Any]) -> list[int]:
    """Items of groups with two or more distinct rewards, or with a single rollout."""
    values: dict[Any, set[float]] = defaultdict(set)
    members: dict[Any, set[Any]] = defaultdict(set)
    for reward, group, rollout in zip(rewards, groups, rollouts, strict=True):
        values[group].add(reward)
        members[group].add(rollout)
    return [i for i, g in enumerate(groups) if len(values[g]) > 1 or len(members[g]) == 1]
