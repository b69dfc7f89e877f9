"""Weight versions travel from each model call into the batch: per token, and per row as a span."""

from __future__ import annotations

from typing import Any

from agl_adapter import RolloutAdapter
from agl_types import CompletedRollout, RolloutState, Triplet

PAD = 0


def _call(prompt: list[int], response: list[int], version: int | None) -> Triplet:
    metadata: dict[str, Any] = {} if version is None else {"server": {"model": "m", "version": version}}
    return Triplet(prompt_token_ids=prompt, response_token_ids=response, metadata=metadata)


def _rollout(triplets: list[Triplet]) -> CompletedRollout:
    return CompletedRollout(
        rollout_id="r",
        data_id="d",
        step=1,
        sample_idx_in_step=0,
        enqueue_time=0.0,
        final_reward=1.0,
        triplets=triplets,
        rollout_state=RolloutState.SUCCEEDED,
    )


def _adapter(level: str) -> RolloutAdapter:
    return RolloutAdapter(
        max_prompt_length=4, max_response_length=8, pad_token_id=PAD, trace_aggregator_level=level
    )


# Turn 1: prompt [1, 2] -> [3, 4] served by version 3; the tool adds [5]; turn 2 continues with
# [6, 7] served by version 4 (a push happened between the two calls).
SPANNING = [_call([1, 2], [3, 4], 3), _call([1, 2, 3, 4, 5], [6, 7], 4)]


def test_a_trajectory_row_spanning_a_push_carries_each_tokens_version() -> None:
    batch, _ = _adapter("trajectory").build_batch([_rollout(SPANNING)])
    # Response side: [3, 4] (v3), observation [5] (the prompt of the v4 call), [6, 7] (v4), padding -1.
    assert batch.response_weight_versions.tolist() == [[3, 3, 4, 4, 4, -1, -1, -1]]
    assert batch.weight_version_min.tolist() == [3]
    assert batch.weight_version_max.tolist() == [4]


def test_transition_rows_each_carry_their_calls_version() -> None:
    batch, _ = _adapter("transition").build_batch([_rollout(SPANNING)])
    assert batch.response_weight_versions.tolist() == [[3, 3] + [-1] * 6, [4, 4] + [-1] * 6]
    assert batch.weight_version_min.tolist() == [3, 4]
    assert batch.weight_version_max.tolist() == [3, 4]


def test_calls_without_a_recorded_version_are_minus_one_and_do_not_count_in_the_span() -> None:
    calls = [_call([1, 2], [3, 4], None), _call([1, 2, 3, 4, 5], [6, 7], 2)]
    batch, _ = _adapter("trajectory").build_batch([_rollout(calls)])
    assert batch.response_weight_versions.tolist() == [[-1, -1, 2, 2, 2, -1, -1, -1]]
    assert batch.weight_version_min.tolist() == [2]
    assert batch.weight_version_max.tolist() == [2]


def test_a_row_with_no_recorded_version_has_span_minus_one() -> None:
    batch, _ = _adapter("trajectory").build_batch([_rollout([_call([1], [2], None)])])
    assert batch.weight_version_min.tolist() == [-1]
    assert batch.weight_version_max.tolist() == [-1]


def test_versions_are_cut_with_a_truncated_response() -> None:
    calls = [_call([1], [2, 3, 4, 5, 6], 0), _call([1, 2, 3, 4, 5, 6, 7], [8, 9, 10], 1)]
    batch, _ = _adapter("trajectory").build_batch([_rollout(calls)])
    # 5 + 1 (observation) + 3 = 9 response tokens, cut to 8: the last v1 token goes.
    assert batch.response_weight_versions.tolist() == [[0, 0, 0, 0, 0, 1, 1, 1]]
    assert batch.weight_version_max.tolist() == [1]
