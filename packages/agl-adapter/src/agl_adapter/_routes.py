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
from typing import Protocol

import numpy as np
import torch
from numpy.typing import NDArray

from agl_adapter.errors import InvalidRoutesError

logger = logging.getLogger("agl_adapter")

RouteArray = NDArray[np.uint8]
_MAX_EXPERT_ID = int(np.iinfo(np.uint8).max)


@dataclass(frozen=True, slots=True)
class RowRoutes:
    """A row's routes: the payload of the call they come from (the row's ``routes_turn``), and the
    lengths that place it (the untruncated prompt, then the kept prompt and response)."""

    payload: str
    original_prompt_length: int
    prompt_length: int
    response_length: int


class RoutedRow(Protocol):
    """What placing routes reads of a training row (:class:`agl_adapter._rows.TrainingRow`)."""

    @property
    def rollout_id(self) -> str: ...
    @property
    def routes(self) -> RowRoutes | None: ...
    @property
    def routes_turn(self) -> int: ...


def _call(row: RoutedRow) -> str:
    """The model call a row's routes come from, for error messages."""
    return f"rollout {row.rollout_id!r} turn {row.routes_turn}"


def decode_routes(routes: RowRoutes, call: str) -> RouteArray:
    """The payload as a (tokens, layers, top_k) uint8 array; raises InvalidRoutesError naming ``call``
    when it is not a base64 ``.npy`` of integer expert ids in 0..255 covering the row."""
    try:
        array = np.load(io.BytesIO(base64.b64decode(routes.payload, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as exc:
        raise InvalidRoutesError(f"{call}: routed_experts is not a base64 .npy array ({exc})") from exc
    if array.ndim != 3 or not np.issubdtype(array.dtype, np.integer):
        raise InvalidRoutesError(
            f"{call}: routed_experts must be an integer array of shape (tokens, layers, top_k), "
            f"got {array.dtype} of shape {array.shape}"
        )
    if array.size and (int(array.min()) < 0 or int(array.max()) > _MAX_EXPERT_ID):
        raise InvalidRoutesError(
            f"{call}: expert ids span {int(array.min())}..{int(array.max())}, but the "
            f"routed_experts tensor is uint8 (0..{_MAX_EXPERT_ID})"
        )
    needed = routes.original_prompt_length + routes.response_length - 1
    if len(array) < needed:
        raise InvalidRoutesError(
            f"{call}: routed_experts covers {len(array)} tokens, but the row's "
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
    rows: Sequence[RoutedRow], *, max_prompt_length: int, max_response_length: int, required: bool
) -> torch.Tensor | None:
    """The (N, P + R, layers, top_k) uint8 tensor, or None when no row has routes or some lack them
    and they are not ``required`` (a warning says so); a required row without routes raises."""
    missing = [row for row in rows if row.routes is None]
    if missing and required:
        raise InvalidRoutesError(
            f"R3 routing replay needs routed_experts on every training row, but {len(missing)} of {len(rows)} "
            f"rows have none (first: {_call(missing[0])}); start the gateway "
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
    decoded: dict[str, RouteArray] = {}  # rows that borrowed one call's routes share its payload
    placed: list[tuple[RowRoutes, RouteArray]] = []
    shape: tuple[int, ...] = ()
    for row in rows:
        routes = row.routes
        assert routes is not None  # rows without routes returned above
        array = decoded.get(routes.payload)
        if array is None:
            array = decoded[routes.payload] = decode_routes(routes, _call(row))
        if not placed:
            shape = array.shape[1:]
        elif array.shape[1:] != shape:
            raise InvalidRoutesError(
                f"{_call(row)}: routed_experts has (layers, top_k) {array.shape[1:]}, but {_call(rows[0])} "
                f"has {shape}; every call of a batch must come from one model"
            )
        placed.append((routes, array))
    out = np.zeros((len(rows), max_prompt_length + max_response_length, *shape), dtype=np.uint8)
    for i, (routes, array) in enumerate(placed):
        place_routes(out[i], routes, array, max_prompt_length)
    return torch.from_numpy(out)


__all__ = ("RoutedRow", "RowRoutes", "decode_routes", "place_routes", "routed_experts_tensor")
