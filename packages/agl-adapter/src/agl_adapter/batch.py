"""The padded training batch: typed tensors and arrays, verl-free, with a conversion to verl's DataProto."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from numpy.typing import NDArray

from agl_adapter._images import VisionEncoder
from agl_adapter._routes import routed_experts_tensor
from agl_adapter._rows import UNKNOWN_VERSION, TrainingRow

if TYPE_CHECKING:
    from verl import DataProto

logger = logging.getLogger("agl_adapter")

_NON_TENSOR_FIELDS = (
    "data_id_list",
    "rollout_id_list",
    "turn_index_list",
    "weight_version_min",
    "weight_version_max",
    "multi_modal_inputs",
)


@dataclass(frozen=True)
class AdapterBatch:
    """One verl training batch of N rows; P = max_prompt_length, R = max_response_length.

    Tensors: ``prompts`` (N, P) long, left-padded; ``responses`` (N, R) long, right-padded (model
    tokens and tool observations); ``input_ids``, ``attention_mask`` (N, P+R) long; ``position_ids``
    (N, P+R) long, or (N, 4, P+R) for an mrope vision-language model when a row has images (a text
    row over its three vision rows);
    ``response_mask`` (N, R) long, 1 = model token; ``is_drop_mask`` (N,) bool, prompt overflow or images that cannot be trained on;
    ``token_level_scores`` (N, R) float32, the row reward on its last response token;
    ``rollout_log_probs`` (N, R) float32 or None unless every row has log-probs;
    ``response_weight_versions`` (N, R) long, the weight version that produced each response token
    (a row spans several when a push happened between its model calls), -1 in padding and where the
    gateway recorded none; ``routed_experts`` (N, P+R, layers, top_k) uint8 or None, the MoE experts
    each prompt and response token was routed to by the inference engine (R3 routing replay), zeros in
    padding and under the last generated token of the call the routes come from (never routed),
    present only when every row has routes.
    Arrays: ``data_id_list``, ``rollout_id_list`` (N,) object (str); ``turn_index_list`` (N,) int64
    at transition level, else None; ``weight_version_min``, ``weight_version_max`` (N,) int64, the
    oldest and newest version of the row's model tokens (-1: none known); ``multi_modal_inputs``
    (N,) object, when a row has images: each row's vision tensors (``pixel_values``,
    ``image_grid_thw``, ...) as a dict, None for a row without images.
    """

    prompts: torch.Tensor
    responses: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    is_drop_mask: torch.Tensor
    token_level_scores: torch.Tensor
    rollout_log_probs: torch.Tensor | None
    response_weight_versions: torch.Tensor
    routed_experts: torch.Tensor | None
    data_id_list: NDArray[np.object_]
    rollout_id_list: NDArray[np.object_]
    turn_index_list: NDArray[np.int64] | None
    weight_version_min: NDArray[np.int64]
    weight_version_max: NDArray[np.int64]
    multi_modal_inputs: NDArray[np.object_] | None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The batch's tensors by verl key; ``rollout_log_probs`` and ``routed_experts`` only when present."""
        out: dict[str, torch.Tensor] = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.Tensor):
                out[field.name] = value
        return out

    def non_tensors(self) -> dict[str, NDArray[Any]]:
        """The per-row numpy arrays by verl key; ``turn_index_list`` only at transition level,
        ``multi_modal_inputs`` only when a row has images."""
        out: dict[str, NDArray[Any]] = {}
        for name in _NON_TENSOR_FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    def to(self, device: torch.device | str) -> AdapterBatch:
        """The same batch with every tensor on ``device``."""
        moved = {name: tensor.to(device) for name, tensor in self.tensors().items()}
        return replace(self, **moved)

    def to_data_proto(self) -> DataProto:
        """verl's ``DataProto``: a TensorDict of the tensors (batch_size N), numpy arrays, empty meta_info."""
        try:
            from tensordict import TensorDict
            from verl import DataProto
        except ImportError as exc:
            raise ImportError(
                "AdapterBatch.to_data_proto needs verl; install it with `pip install 'agl-adapter[verl]'`"
            ) from exc
        batch = TensorDict(self.tensors(), batch_size=[len(self)])
        return DataProto(batch=batch, non_tensor_batch=self.non_tensors(), meta_info={})


def assemble_batch(
    rows: Sequence[TrainingRow],
    *,
    max_prompt_length: int,
    max_response_length: int,
    pad_token_id: int,
    include_turn_index: bool,
    require_routed_experts: bool = False,
    vision: VisionEncoder | None = None,
) -> AdapterBatch:
    """Pad rows into the batch tensors; one numpy copy per row and array, no per-token Python work.

        ``require_routed_experts`` makes a row without MoE routes an InvalidRoutesError instead of a
        batch without ``routed_experts``. ``vision``, the processor of a vision-language model, encodes the
    rows' images and drops rows whose images and tokens disagree.

        ``position_ids`` is computed in closed form, ``clip(col - first_valid_col, 0, n_valid - 1)``,
        which equals verl's ``clamp(cumsum(attention_mask) - 1, min=0)`` for a contiguous mask.
    """
    n, p, r = len(rows), max_prompt_length, max_response_length
    input_ids = np.full((n, p + r), pad_token_id, dtype=np.int64)
    attention_mask = np.zeros((n, p + r), dtype=np.int64)
    response_mask = np.zeros((n, r), dtype=np.int64)
    versions = np.full((n, r), UNKNOWN_VERSION, dtype=np.int64)
    has_log_probs = [row.log_probs is not None for row in rows]
    log_probs = np.zeros((n, r), dtype=np.float32) if all(has_log_probs) else None
    if any(has_log_probs) and log_probs is None:
        logger.warning(
            "%d of %d rows lack log-probs; omitting rollout_log_probs from the batch",
            has_log_probs.count(False),
            n,
        )
    starts = np.empty(n, dtype=np.int64)
    ends = np.empty(n, dtype=np.int64)
    for i, row in enumerate(rows):
        start, n_response = p - len(row.prompt), len(row.response)
        starts[i], ends[i] = start, p + n_response
        input_ids[i, start:p] = row.prompt
        input_ids[i, p : p + n_response] = row.response
        attention_mask[i, start : p + n_response] = 1
        response_mask[i, :n_response] = row.response_mask
        versions[i, :n_response] = row.versions
        if log_probs is not None and row.log_probs is not None:
            log_probs[i, :n_response] = row.log_probs
    position_ids = np.empty((n, p + r), dtype=np.int64)
    np.subtract(np.arange(p + r, dtype=np.int64)[None, :], starts[:, None], out=position_ids)
    np.clip(position_ids, 0, (ends - starts - 1)[:, None], out=position_ids)
    scores = np.zeros((n, r), dtype=np.float32)
    scores[np.arange(n), ends - p - 1] = np.array([row.reward for row in rows], dtype=np.float32)
    spans = np.array([row.version_span() for row in rows], dtype=np.int64).reshape(n, 2)
    input_ids_t, attention_mask_t = torch.from_numpy(input_ids), torch.from_numpy(attention_mask)
    position_ids_t, multi_modal_inputs = torch.from_numpy(position_ids), None
    is_drop = np.array([row.is_drop for row in rows], dtype=np.bool_)
    if vision is not None:
        encoded = vision.encode(rows, input_ids_t, attention_mask_t)
        multi_modal_inputs = encoded.multi_modal_inputs
        is_drop[list(encoded.dropped)] = True
        if encoded.position_ids is not None:
            position_ids_t = encoded.position_ids
    return AdapterBatch(
        prompts=torch.from_numpy(input_ids[:, :p].copy()),
        responses=torch.from_numpy(input_ids[:, p:].copy()),
        input_ids=input_ids_t,
        attention_mask=attention_mask_t,
        position_ids=position_ids_t,
        response_mask=torch.from_numpy(response_mask),
        is_drop_mask=torch.from_numpy(is_drop),
        token_level_scores=torch.from_numpy(scores),
        rollout_log_probs=None if log_probs is None else torch.from_numpy(log_probs),
        response_weight_versions=torch.from_numpy(versions),
        routed_experts=routed_experts_tensor(
            rows, max_prompt_length=p, max_response_length=r, required=require_routed_experts
        ),
        data_id_list=np.array([row.data_id for row in rows], dtype=object),
        rollout_id_list=np.array([row.rollout_id for row in rows], dtype=object),
        turn_index_list=np.array([row.turn_index for row in rows], dtype=np.int64)
        if include_turn_index
        else None,
        weight_version_min=spans[:, 0].copy(),
        weight_version_max=spans[:, 1].copy(),
        multi_modal_inputs=multi_modal_inputs,
    )


__all__ = ("AdapterBatch", "assemble_batch")
