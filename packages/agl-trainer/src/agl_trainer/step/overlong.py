"""Pipeline stage 2b: DAPO's overlong reward shaping on each rollout's reward.

Read from verl's own keys (its DAPO recipe passes them to the reward manager):
``reward.reward_kwargs.overlong_buffer_cfg.{enable,len,penalty_factor}`` and
``reward.reward_kwargs.max_resp_len`` (default: the adapter's ``max_response_length``). The length
is a rollout's trained response tokens over all its rows, and the penalty
(:func:`agl_algos.overlong_reward_penalty`) is added to the reward every row of the rollout carries,
on its last response token, before the batch is cut and the advantages computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig
from verl import DataProto

from agl_algos import OverlongBuffer, overlong_reward_penalty, rollout_token_totals

__all__ = ("OVERLONG_KEY", "OverlongShaping")

OVERLONG_KEY = "reward.reward_kwargs.overlong_buffer_cfg"


@dataclass(frozen=True, slots=True)
class OverlongShaping:
    """The penalty's parameters; build with :meth:`from_config` (None when it is off)."""

    buffer: OverlongBuffer

    @classmethod
    def from_config(cls, config: DictConfig, max_response_length: int) -> OverlongShaping | None:
        """None unless ``overlong_buffer_cfg.enable`` is true; invalid values raise ``ValueError``
        naming the key."""
        kwargs = (config.get("reward") or {}).get("reward_kwargs") or {}
        section = kwargs.get("overlong_buffer_cfg")
        if section is None or not section.get("enable", False):
            return None
        max_len = kwargs.get("max_resp_len") or max_response_length
        try:
            return cls(OverlongBuffer.from_config(section, int(max_len)))
        except ValueError as error:
            raise ValueError(f"{OVERLONG_KEY}: {error}") from error

    def apply(self, batch: DataProto, metrics: dict[str, Any]) -> None:
        """Add each row's rollout penalty to its reward in ``token_level_scores``; log
        ``training/overlong/penalty_mean`` (over rows) and ``training/overlong/rows_penalized``."""
        response_mask = batch.batch["response_mask"]
        lengths = rollout_token_totals(response_mask, batch.non_tensor_batch["rollout_id_list"])
        penalty = overlong_reward_penalty(lengths, self.buffer)
        scores = batch.batch["token_level_scores"]
        width = scores.shape[-1]
        last = batch.batch["attention_mask"][:, -width:].sum(-1) - 1
        rows = torch.arange(len(batch))
        scores[rows, last.clamp(min=0)] += penalty.to(scores.dtype)
        metrics["training/overlong/penalty_mean"] = float(penalty.mean()) if len(batch) else 0.0
        metrics["training/overlong/rows_penalized"] = int((penalty < 0).sum())
