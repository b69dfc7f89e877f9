"""Stage 3: DAPO's overlong reward shaping on each rollout's reward.

Read from verl's own keys (its DAPO recipe passes them to the reward manager):
``reward.reward_kwargs.overlong_buffer_cfg.{enable,len,penalty_factor}`` and
``reward.reward_kwargs.max_resp_len`` (default: the adapter's ``max_response_length``). The length
is a rollout's trained response tokens over all its rows, and the penalty
(:func:`agl_algos.overlong_reward_penalty`) is added to the reward every row of the rollout carries,
on its last response token, before the batch is cut and the advantages computed.
"""

from __future__ import annotations

from typing import Any

import torch
from verl import DataProto

from agl_algos import overlong_reward_penalty, rollout_token_totals
from agl_trainer.settings import OverlongSettings

__all__ = ("shape_overlong",)


def shape_overlong(batch: DataProto, settings: OverlongSettings) -> tuple[DataProto, dict[str, Any]]:
    """Add each row's rollout penalty to its reward in ``token_level_scores``; log
    ``training/overlong/penalty_mean`` (over rows) and ``training/overlong/rows_penalized``."""
    response_mask = batch.batch["response_mask"]
    lengths = rollout_token_totals(response_mask, batch.non_tensor_batch["rollout_id_list"])
    penalty = overlong_reward_penalty(lengths, settings.buffer)
    scores = batch.batch["token_level_scores"]
    width = scores.shape[-1]
    last = batch.batch["attention_mask"][:, -width:].sum(-1) - 1
    rows = torch.arange(len(batch))
    scores[rows, last.clamp(min=0)] += penalty.to(scores.dtype)
    return batch, {
        "training/overlong/penalty_mean": float(penalty.mean()) if len(batch) else 0.0,
        "training/overlong/rows_penalized": int((penalty < 0).sum()),
    }
