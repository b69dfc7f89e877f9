"""Rollout-level advantage on a verl ``DataProto`` (the trainer's entry point)."""

from __future__ import annotations

from enum import Enum
from typing import Any

import numpy as np
import torch

from agl_algos.advantage import (
    broadcast_rollout_scalars,
    compute_rollout_level_advantage,
    extract_rollout_scalars,
    rollout_layout,
)
from agl_algos.errors import MissingFieldError, RemaxNotSupportedError
from agl_algos.verl._compat import compute_advantage_fn

__all__ = ("compute_rollout_level_advantage_data_proto",)


def _estimator_name(adv_estimator: object) -> str:
    value = adv_estimator.value if isinstance(adv_estimator, Enum) else adv_estimator
    return str(value).lower()


def _non_tensor(batch: Any, key: str) -> Any:
    values = batch.non_tensor_batch.get(key)
    if values is None:
        raise MissingFieldError(
            f"rollout-level advantage needs non_tensor_batch[{key!r}]; the adapter sets it"
        )
    if len(values) != len(batch):
        raise MissingFieldError(
            f"non_tensor_batch[{key!r}] has {len(values)} entries but the batch has {len(batch)} rows"
        )
    return values


def _tensor(batch: Any, key: str) -> torch.Tensor:
    if batch.batch is None or key not in batch.batch:
        raise MissingFieldError(
            f"rollout-level advantage needs batch[{key!r}] (shape rows x response_length)"
        )
    return batch.batch[key]


def _uids(batch: Any) -> Any:
    key = "uid" if batch.non_tensor_batch.get("uid") is not None else "data_id_list"
    if batch.non_tensor_batch.get(key) is None:
        raise MissingFieldError(
            "rollout-level advantage needs non_tensor_batch['uid'] or ['data_id_list'] (the GRPO group key)"
        )
    return _non_tensor(batch, key)


def compute_rollout_level_advantage_data_proto(
    batch: Any,
    *,
    adv_estimator: object,
    gamma: float = 1.0,
    lam: float = 1.0,
    num_repeat: int = 1,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> tuple[Any, dict[str, int]]:
    """Write rollout-level ``advantages`` and ``returns`` (N, T float32) into ``batch.batch``.

    Reads ``non_tensor_batch["rollout_id_list"]``, ``["uid"]`` (or ``["data_id_list"]`` when uid is
    absent; it is not written back), ``batch["token_level_rewards"]`` and ``batch["response_mask"]``.
    GRPO is computed here (:func:`agl_algos.compute_rollout_level_advantage`); any other outcome
    estimator is delegated to verl's ``compute_advantage`` on a copy holding one representative row per
    rollout, and its per-rollout scalar is broadcast the same way. REMAX raises
    :class:`RemaxNotSupportedError`. Returns the same batch object and the
    ``training/rollout_level_advantage/*`` counts.
    """
    estimator = _estimator_name(adv_estimator)
    if estimator == "remax":
        raise RemaxNotSupportedError(
            "adv_estimator=remax is not supported: REMAX needs a greedy baseline rollout per sample; "
            "use grpo, rloo or reinforce_plus_plus"
        )
    rollout_ids = _non_tensor(batch, "rollout_id_list")
    uids = _uids(batch)
    rewards = _tensor(batch, "token_level_rewards")
    mask = _tensor(batch, "response_mask")
    if estimator == "grpo":
        result = compute_rollout_level_advantage(
            rewards, mask, rollout_ids, uids, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo
        )
        advantages, returns, metrics = result.advantages, result.returns, result.metrics()
    else:
        layout = rollout_layout(rollout_ids, uids, rewards.detach().float().sum(-1))
        representatives = batch.select_idxs(layout.representatives)
        representatives.non_tensor_batch["uid"] = np.asarray(uids)[layout.representatives]
        out = compute_advantage_fn()(
            representatives,
            adv_estimator=adv_estimator,
            gamma=gamma,
            lam=lam,
            num_repeat=num_repeat,
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
            config=config,
        )
        rep_mask = out.batch["response_mask"]
        scalars = extract_rollout_scalars(out.batch["advantages"], rep_mask, layout.rollout_ids)
        advantages = broadcast_rollout_scalars(scalars, layout.rollout_of_row, mask)
        returns = advantages.clone()
        if "returns" in out.batch:
            return_scalars = extract_rollout_scalars(out.batch["returns"], rep_mask, layout.rollout_ids)
            returns = broadcast_rollout_scalars(return_scalars, layout.rollout_of_row, mask)
        metrics = layout.metrics()
    batch.batch["advantages"] = advantages
    batch.batch["returns"] = returns
    return batch, metrics
