"""Stage 4: the adapter's batch cut to what the actor trains on."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from verl import DataProto

from agl_algos import mini_batch_keep_count, row_rewards_from_scores, select_rows_to_keep
from agl_trainer.settings import BatchSettings

logger = logging.getLogger("agl_trainer")


def cut_batch(
    batch: DataProto, settings: BatchSettings, *, rng: np.random.Generator, step: int
) -> tuple[DataProto | None, dict[str, Any]]:
    """uid = data_id; drop prompt-overflow rows; cut to a multiple of the mini-batch, same-reward first.

    The batch is None (and the log says why) when no trainable row is left.
    """
    batch.non_tensor_batch["uid"] = np.array(batch.non_tensor_batch["data_id_list"], dtype=object)
    metrics: dict[str, Any] = {"training/n_sample_collected": len(batch)}
    keep = (~batch.batch["is_drop_mask"]).nonzero(as_tuple=True)[0]
    metrics["training/n_sample_dropped/marked"] = len(batch) - len(keep)
    if len(keep) < len(batch):
        batch = select_rows(batch, keep)
    n_keep = mini_batch_keep_count(
        len(batch), settings.mini_batch_rows, max_ppo_update_times=settings.max_ppo_update_times
    )
    selection = select_rows_to_keep(
        batch.non_tensor_batch["uid"], row_rewards_from_scores(batch.batch["token_level_scores"]), n_keep, rng
    )
    metrics.update(selection.metrics())
    if len(selection.keep) == 0:
        logger.warning(
            "step %d: no trainable rows after dropping and flooring to a multiple of %d rows "
            "(ppo_mini_batch_size x rollout.n); the step trains nothing",
            step,
            settings.mini_batch_rows,
        )
        return None, metrics
    if len(selection.keep) < len(batch):
        batch = select_rows(batch, torch.as_tensor(selection.keep))
    batch.meta_info["temperature"] = settings.temperature
    batch.meta_info["global_token_num"] = torch.sum(batch.batch["attention_mask"], dim=-1).tolist()
    return batch, metrics


def select_rows(batch: DataProto, rows: torch.Tensor) -> DataProto:
    """The rows ``rows`` (1-D index tensor) of ``batch`` as a new DataProto."""
    selected = batch[rows]
    assert isinstance(selected, DataProto)
    return selected


__all__ = ("cut_batch", "select_rows")
