"""R3 routing replay: each row's MoE routes → the batch's ``routed_experts`` tensor.

The gateway records, per model call, the experts every token was routed to: a base64 ``.npy`` of
shape (tokens, layers, top_k) covering the call's prompt and all but its last generated token
(that one was never fed back through the model). A row's routes come from the last call it
merges, whose context holds every earlier token of the row; they are placed under the row's
prompt (left-padded) and response (right-padded) ids, zeros elsewhere, so verl's router replay
sees the routing the inference engine used.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from numpy.typing import NDArray

from agl_adapter.errors import InvalidRoutesError

if TYPE_CHECKING:
    from agl_adapter._rows import TrainingRow

logger = logging.getLogger("agl_adapter")

RouteArray = NDArray[np.uint8]
_MAX_EXPERT_ID = int(np.iinfo(np.uint8).max)


@dataclass(frozen=True, slots=True)
class RowRoutes:
    """Where a row's routes come from: the payload of model call ``turn`` of ``rollout_id``, and the
    lengths that place it (the untruncated prompt, then the kept prompt and response)."""

    payload: str
    rollout_id: str
    turn: int
    original_prompt_length: int
    prompt_length: int
    response_length: int

    def where(self) -> str:
        return f"rollout {self.rollout_id!r} turn {self.turn}"


def decode_routes(routes: RowRoutes) -> RouteArray:
    """The payload as a (tokens, ...) uint8 array; raises InvalidRoutesError naming the call when it
    is not a base64 ``.npy`` of integer expert ids in 0..255."""
    try:
        array = np.load(io.BytesIO(base64.b64decode(routes.payload, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as exc:
        raise InvalidRoutesError(
            f"{routes.where()}: routed_experts is not a base64 .npy array ({exc})"
        ) from exc
    if array.ndim != 3 or not np.issubdtype(array.dtype, np.integer):
        raise InvalidRoutesError(
            f"{routes.where()}: routed_experts must be an integer array of shape (tokens, layers, top_k), "
            f"got {array.dtype} of shape {array.shape}"
        )
    if array.size and (int(array.min()) < 0 or int(array.max()) > _MAX_EXPERT_ID):
        raise InvalidRoutesError(
            f"{routes.where()}: expert ids span {int(array.min())}..{int(array.max())}, but the "
            f"routed_experts tensor is uint8 (0..{_MAX_EXPERT_ID})"
        )
    needed = routes.original_prompt_length + routes.response_length - 1
    if len(array) < needed:
        raise InvalidRoutesError(
            f"{routes.where()}: routed_experts covers {len(array)} tokens, but the row's "
            f"{routes.original_prompt_length} prompt and {routes.response_length} response tokens need "
            f"at least {needed}"
        )
    return array.astype(np.uint8, copy=False)


def place_routes(out: RouteArray, routes: RowRoutes, array: RouteArray, max_prompt_length: int) -> None:
    """Write ``array`` into one (P + R, ...) row of the batch, under the row's prompt and response ids."""
    n_prompt = routes.prompt_length
    start = max_prompt_length - n_prompt
    out[start:max_prompt_length] = array[:n_prompt]
    first = routes.original_prompt_length
    n_response = min(routes.response_length, len(array) - first)
    if n_response > 0:
        out[max_prompt_length : max_prompt_length + n_response] = array[first : first + n_response]


def routed_experts_tensor(
    rows: Sequence[TrainingRow], *, max_prompt_length: int, max_response_length: int, required: bool
) -> torch.Tensor | None:
    """The (N, P + R, layers, top_k) uint8 tensor, or None when no row has routes or some lack them
    and they are not ``required`` (a warning says so); a required row without routes raises."""
    missing = [row for row in rows if row.routes is None]
    if missing and required:
        first = missing[0]
        raise InvalidRoutesError(
            f"R3 routing replay needs routed_experts on every training row, but {len(missing)} of {len(rows)} "
            f"rows have none (first: rollout {first.rollout_id!r} turn {first.routes_turn}); start the gateway "
            "with include_routed_experts and fetch the routes with the triplets "
            "(RolloutManagerConfig.include_routed_experts)"
        )
    if len(missing) == len(rows):
        return None
    if missing:
        logger.warning(
            "%d of %d rows lack routed_experts; omitting routed_experts from the batch",
            len(missing),
            len(rows),
        )
        return None
    present = [row.routes for row in rows if row.routes is not None]
    decoded: dict[str, RouteArray] = {}  # rows that borrowed one call's routes share its payload
    arrays: list[RouteArray] = []
    for routes in present:
        array = decoded.get(routes.payload)
        if array is None:
            array = decoded[routes.payload] = decode_routes(routes)
        arrays.append(array)
    shape = arrays[0].shape[1:]
    for routes, array in zip(present, arrays, strict=True):
        if array.shape[1:] != shape:
            raise InvalidRoutesError(
                f"{routes.where()}: routed_experts has (layers, top_k) {array.shape[1:]}, but "
                f"{present[0].where()} has {shape}; every call of a batch must come from one model"
            )
    out = np.zeros((len(rows), max_prompt_length + max_response_length, *shape), dtype=np.uint8)
    for i, (routes, array) in enumerate(zip(present, arrays, strict=True)):
        place_routes(out[i], routes, array, max_prompt_length)
    return torch.from_numpy(out)


__all__ = ("RowRoutes", "decode_routes", "place_routes", "routed_experts_tensor")
