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
