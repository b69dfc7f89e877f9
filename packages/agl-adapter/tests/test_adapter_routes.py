"""R3 routing replay: model calls' MoE routes → the batch's ``routed_experts``, exact tensors.

A call's routes (base64 ``.npy``, (tokens, layers, top_k)) cover its prompt and all but its last
generated token; the batch puts them under the row's left-padded prompt and right-padded response.
"""

from __future__ import annotations

import base64
import io
import logging
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_adapter import InvalidRoutesError, RolloutAdapter
from agl_testing.routes import npy_payload, succeeded_rollout
from agl_types import CompletedRollout, Triplet

PAD = 0
LAYERS, TOP_K = 2, 2


def _route(token: int) -> np.ndarray:
    """The (layers, top_k) experts a token is routed to, a function of the token id alone."""
    return (token * 3 + np.arange(LAYERS * TOP_K).reshape(LAYERS, TOP_K)) % 256


def _engine_routes(prompt: Sequence[int], response: Sequence[int]) -> str:
    """What the engine returns for a call: one route per context token but the last generated one."""
    context = [*prompt, *response][:-1]
    return npy_payload(np.stack([_route(t) for t in context]).astype(np.int32))


def _t(prompt: list[int], response: list[int], routes: str | None = None) -> Triplet:
    return Triplet(prompt_token_ids=prompt, response_token_ids=response, routed_experts=routes)


def _routed(prompt: list[int], response: list[int]) -> Triplet:
    return _t(prompt, response, _engine_routes(prompt, response))


def _adapter(level: str = "transition", p: int = 4, r: int = 4, **kw: object) -> RolloutAdapter:
    return RolloutAdapter(
        max_prompt_length=p,
        max_response_length=r,
        pad_token_id=PAD,
        trace_aggregator_level=level,
        mismatch_sink=_NullSink(),
        **kw,  # pyright: ignore[reportArgumentType]
    )


class _NullSink:
    def write(self, entries: object, global_steps: int) -> None:
        return None


def _routes_of(adapter: RolloutAdapter, rollouts: Sequence[CompletedRollout]) -> torch.Tensor:
    batch, _ = adapter.build_batch(rollouts)
    assert batch.routed_experts is not None
    return batch.routed_experts


def _rows(*columns: list[int | None]) -> torch.Tensor:
    """Expected rows, one token id per column (None: padding or no route), as route tensors."""
    zero = np.zeros((LAYERS, TOP_K), dtype=np.uint8)
    return torch.from_numpy(
        np.stack(
            [np.stack([zero if t is None else _route(t).astype(np.uint8) for t in row]) for row in columns]
        )
    )


def test_routes_sit_under_the_padded_prompt_and_response_with_zeros_in_padding_and_the_last_token() -> None:
    routes = _routes_of(_adapter(), [succeeded_rollout([_routed([1, 2, 3], [4, 5])])])
    assert routes.dtype == torch.uint8
    assert routes.shape == (1, 8, LAYERS, TOP_K)
    assert torch.equal(routes, _rows([None, 1, 2, 3, 4, None, None, None]))


def test_a_merged_row_takes_the_routes_of_its_last_call() -> None:
    first = _t([1, 2], [3])  # the server dropped these routes once the next call carried them
    second = _routed([1, 2, 3, 7], [8, 9])
    routes = _routes_of(_adapter("trajectory", p=3, r=5), [succeeded_rollout([first, second])])
    assert torch.equal(routes, _rows([None, 1, 2, 3, 7, 8, None, None]))


def test_a_merged_row_without_its_last_calls_routes_is_named_by_that_call() -> None:
    first = _routed([1, 2], [3])
    second = _t([1, 2, 3, 7], [8, 9])
    with pytest.raises(InvalidRoutesError, match=r"first: rollout 'r1' turn 1\)"):
        _adapter("trajectory", p=3, r=5, require_routed_experts=True).build_batch(
            [succeeded_rollout([first, second])]
        )


def test_a_transition_row_without_routes_borrows_those_of_the_call_that_continues_it() -> None:
    first = _t([1, 2], [3])
    second = _routed([1, 2, 3, 7], [8, 9])
    routes = _routes_of(_adapter(p=4, r=2), [succeeded_rollout([first, second])])
    assert torch.equal(routes, _rows([None, None, 1, 2, 3, None], [1, 2, 3, 7, 8, None]))


def test_a_transition_row_does_not_borrow_across_a_prefix_break() -> None:
    first = _t([1, 2], [3])
    second = _routed([5, 6], [8])
    with pytest.raises(InvalidRoutesError, match=r"1 of 2 rows have none \(first: rollout 'r1' turn 0\)"):
        _adapter(require_routed_experts=True).build_batch([succeeded_rollout([first, second])])


def test_a_truncated_prompt_keeps_the_routes_of_its_head_and_the_response_those_after_the_full_prompt() -> (
    None
):
    routes = _routes_of(_adapter(p=2, r=3), [succeeded_rollout([_routed([1, 2, 3], [4, 5])])])
    assert torch.equal(routes, _rows([1, 2, 4, None, None]))


def test_a_truncated_response_keeps_the_routes_of_its_kept_tokens() -> None:
    routes = _routes_of(_adapter(p=1, r=2), [succeeded_rollout([_routed([1], [4, 5, 6])])])
    assert torch.equal(routes, _rows([1, 4, 5]))


def test_routes_longer_than_the_call_are_cut_at_the_row() -> None:
    full = npy_payload(np.stack([_route(t) for t in [1, 4, 5]]).astype(np.int64))  # the last token too
    routes = _routes_of(_adapter(p=1, r=3), [succeeded_rollout([_t([1], [4, 5], full)])])
    assert torch.equal(routes, _rows([1, 4, 5, None]))


def test_a_batch_without_routes_has_no_routed_experts_tensor() -> None:
    batch, _ = _adapter().build_batch([succeeded_rollout([_t([1], [2])])])
    assert batch.routed_experts is None
    assert "routed_experts" not in batch.tensors()


def test_routes_on_only_some_rows_are_omitted_with_a_warning_unless_required(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rollouts = [
        succeeded_rollout([_routed([1], [2])]),
        succeeded_rollout([_t([5], [6])], rollout_id="r2", sample=1),
    ]
    with caplog.at_level(logging.WARNING, logger="agl_adapter"):
        batch, _ = _adapter().build_batch(rollouts)
    assert batch.routed_experts is None
    assert "1 of 2 rows lack routed_experts" in caplog.text


def test_required_routes_missing_on_a_row_raise_naming_its_rollout() -> None:
    rollouts = [
        succeeded_rollout([_routed([1], [2])]),
        succeeded_rollout([_t([5], [6])], rollout_id="r2", sample=1),
    ]
    with pytest.raises(InvalidRoutesError, match=r"first: rollout 'r2' turn 0\); start the gateway"):
        _adapter(require_routed_experts=True).build_batch(rollouts)


def test_routes_shorter_than_the_calls_tokens_raise_naming_the_call() -> None:
    short = npy_payload(np.stack([_route(t) for t in [1, 2]]))
    with pytest.raises(
        InvalidRoutesError, match=r"rollout 'r1' turn 0: routed_experts covers 2 tokens.*need at least 3"
    ):
        _adapter().build_batch([succeeded_rollout([_t([1, 2], [3, 4], short)])])


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("not base64!", "is not a base64 .npy array"),
        (base64.b64encode(b"plain bytes").decode(), "is not a base64 .npy array"),
        (npy_payload(np.zeros((3, 2, 2), dtype=np.float32)), "must be an integer array"),
        (npy_payload(np.zeros(3, dtype=np.int32)), "must be an integer array of shape"),
        (npy_payload(np.zeros((3, 2), dtype=np.int32)), "must be an integer array of shape"),
        (npy_payload(np.full((3, 2, 2), 300, dtype=np.int32)), r"expert ids span 300..300, but .* uint8"),
        (npy_payload(np.full((3, 2, 2), -1, dtype=np.int32)), r"expert ids span -1..-1"),
    ],
)
def test_routes_that_are_not_uint8_expert_ids_raise_naming_the_call(payload: str, message: str) -> None:
    with pytest.raises(InvalidRoutesError, match=f"rollout 'r1' turn 0: .*{message}"):
        _adapter().build_batch([succeeded_rollout([_t([1, 2], [3, 4], payload)])])


def test_a_pickled_object_array_is_refused_not_unpickled() -> None:
    buffer = io.BytesIO()
    np.save(buffer, np.array([object()], dtype=object), allow_pickle=True)
    payload = base64.b64encode(buffer.getvalue()).decode()
    with pytest.raises(InvalidRoutesError, match=r"is not a base64 \.npy array"):
        _adapter().build_batch([succeeded_rollout([_t([1, 2], [3, 4], payload)])])


def test_calls_of_different_model_shapes_raise() -> None:
    other = npy_payload(np.zeros((2, 3, 2), dtype=np.int32))
    rollouts = [
        succeeded_rollout([_routed([1], [2])]),
        succeeded_rollout([_t([5], [6, 7], other)], rollout_id="r2", sample=1),
    ]
    with pytest.raises(
        InvalidRoutesError, match=r"rollout 'r2' turn 0: routed_experts has \(layers, top_k\) \(3, 2\)"
    ):
        _adapter().build_batch(rollouts)


@st.composite
def _chains(draw: st.DrawFn) -> tuple[list[list[tuple[list[int], list[int]]]], bool]:
    """Calls grouped in chains (each call continues the previous one's context plus an observation,
    a new chain starts afresh with a marker id of its own), and whether every call keeps its routes or
    only each chain's last."""
    ids = st.lists(st.integers(1, 500), min_size=1, max_size=6)
    chains: list[list[tuple[list[int], list[int]]]] = []
    for marker in range(1000, 1000 + draw(st.integers(1, 3))):
        chain: list[tuple[list[int], list[int]]] = []
        prompt = [marker, *draw(st.lists(st.integers(1, 500), max_size=5))]
        for _ in range(draw(st.integers(1, 3))):
            response = draw(ids)
            chain.append((prompt, response))
            prompt = [*prompt, *response, *draw(st.lists(st.integers(1, 500), max_size=3))]
        chains.append(chain)
    return chains, draw(st.booleans())


@settings(max_examples=150, deadline=None)
@given(
    case=_chains(),
    level=st.sampled_from(["transition", "trajectory"]),
    p=st.integers(1, 12),
    r=st.integers(1, 16),
)
def test_every_attended_token_carries_its_engine_routes_but_a_rows_uncovered_last_token(
    case: tuple[list[list[tuple[list[int], list[int]]]], bool], level: str, p: int, r: int
) -> None:
    chains, every_call_keeps_routes = case
    triplets: list[Triplet] = []
    uncovered: list[bool] = []  # per row: its last response token is its routes' call's last token
    for chain in chains:
        for k, (prompt, response) in enumerate(chain):
            last_of_chain = k == len(chain) - 1
            keeps = every_call_keeps_routes or last_of_chain
            triplets.append(_t(prompt, response, _engine_routes(prompt, response) if keeps else None))
            if level == "transition":
                uncovered.append(keeps and len(response) <= r)
        if level == "trajectory":
            first_prompt, (last_prompt, last_response) = chain[0][0], chain[-1]
            uncovered.append(len(last_prompt) + len(last_response) - len(first_prompt) <= r)
    batch, _ = _adapter(level, p=p, r=r, require_routed_experts=True).build_batch(
        [succeeded_rollout(triplets)]
    )
    assert batch.routed_experts is not None
    expected = np.zeros((len(batch), p + r, LAYERS, TOP_K), dtype=np.uint8)
    for i, (ids, mask) in enumerate(
        zip(batch.input_ids.tolist(), batch.attention_mask.tolist(), strict=True)
    ):
        attended = [col for col, on in enumerate(mask) if on]
        for col in attended[:-1] if uncovered[i] else attended:
            expected[i, col] = _route(ids[col])
    assert torch.equal(batch.routed_experts, torch.from_numpy(expected))
