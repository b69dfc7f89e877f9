"""One test per adapter behaviour, with exact tensors (SPEC §4 and our decisions in DESIGN.md)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from agl_adapter import (
    AdapterBatch,
    EmptyBatchError,
    InvalidTraceError,
    MismatchEntry,
    RolloutAdapter,
)
from agl_types import CompletedRollout, RolloutState, Triplet

PAD = 99


def _t(prompt: list[int], response: list[int], log_probs: list[float] | None = None) -> Triplet:
    return Triplet(prompt_token_ids=prompt, response_token_ids=response, response_log_probs=log_probs)


def _rollout(
    triplets: Sequence[Triplet],
    *,
    rollout_id: str = "r1",
    data_id: str = "d1",
    step: int = 0,
    sample: int = 0,
    reward: float | None = 0.7,
    state: RolloutState = RolloutState.SUCCEEDED,
    timed_out: bool = False,
) -> CompletedRollout:
    return CompletedRollout(
        rollout_id=rollout_id,
        data_id=data_id,
        step=step,
        sample_idx_in_step=sample,
        enqueue_time=0.0,
        final_reward=reward,
        triplets=list(triplets),
        rollout_state=state,
        timed_out=timed_out,
    )


def _unchecked(rollout: CompletedRollout, triplets: list[Triplet]) -> CompletedRollout:
    """``rollout`` holding triplets that skipped validation (as ``model_construct`` lets callers do)."""
    return rollout.model_copy(update={"triplets": triplets})


class _ListSink:
    def __init__(self) -> None:
        self.calls: list[tuple[list[MismatchEntry], int]] = []

    def write(self, entries: Sequence[MismatchEntry], global_steps: int) -> None:
        self.calls.append((list(entries), global_steps))


def _adapter(level: str = "trajectory", p: int = 6, r: int = 8, **kwargs: Any) -> RolloutAdapter:
    kwargs.setdefault("mismatch_sink", _ListSink())
    return RolloutAdapter(
        max_prompt_length=p,
        max_response_length=r,
        pad_token_id=PAD,
        trace_aggregator_level=level,
        **kwargs,
    )


def _build(adapter: RolloutAdapter, rollouts: Sequence[CompletedRollout], **kwargs: int):
    return adapter.build_batch(rollouts, **kwargs)


WORKED = [_t([1, 2], [3, 4]), _t([1, 2, 3, 4, 5, 6], [7]), _t([9], [10, 11])]


def test_worked_example_trajectory_tensors() -> None:
    batch, metrics = _build(_adapter(), [_rollout(WORKED)])
    assert batch.prompts.tolist() == [[PAD] * 4 + [1, 2], [PAD] * 5 + [9]]
    assert batch.responses.tolist() == [[3, 4, 5, 6, 7, PAD, PAD, PAD], [10, 11] + [PAD] * 6]
    assert batch.response_mask.tolist() == [[1, 1, 0, 0, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]]
    assert batch.input_ids.tolist() == [
        [PAD] * 4 + [1, 2, 3, 4, 5, 6, 7, PAD, PAD, PAD],
        [PAD] * 5 + [9, 10, 11] + [PAD] * 6,
    ]
    assert batch.attention_mask.tolist() == [[0] * 4 + [1] * 7 + [0] * 3, [0] * 5 + [1] * 3 + [0] * 6]
    assert batch.position_ids.tolist() == [
        [0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 6, 6, 6],
        [0, 0, 0, 0, 0, 0, 1, 2, 2, 2, 2, 2, 2, 2],
    ]
    expected_scores = torch.zeros(2, 8)
    expected_scores[0, 4] = expected_scores[1, 1] = 0.7
    assert torch.equal(batch.token_level_scores, expected_scores)
    assert batch.is_drop_mask.tolist() == [False, False]
    assert batch.rollout_id_list.tolist() == ["r1", "r1"]
    assert batch.data_id_list.tolist() == ["d1", "d1"]
    assert batch.turn_index_list is None
    assert metrics["training/n_unmerged_rollouts"] == 1
    assert metrics["training/n_trace_merge_mismatch_rows"] == 1


def test_tensor_keys_dtypes_and_shapes_are_exactly_verl_s() -> None:
    triplets = [_t([1, 2], [3, 4], [-0.5, -0.25])]
    batch, _ = _build(_adapter(p=6, r=8), [_rollout(triplets)])
    tensors = batch.tensors()
    assert {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()} == {
        "prompts": (torch.int64, (1, 6)),
        "responses": (torch.int64, (1, 8)),
        "input_ids": (torch.int64, (1, 14)),
        "attention_mask": (torch.int64, (1, 14)),
        "position_ids": (torch.int64, (1, 14)),
        "response_mask": (torch.int64, (1, 8)),
        "is_drop_mask": (torch.bool, (1,)),
        "token_level_scores": (torch.float32, (1, 8)),
        "rollout_log_probs": (torch.float32, (1, 8)),
        "response_weight_versions": (torch.int64, (1, 8)),
    }
    assert all(t.is_contiguous() for t in tensors.values())
    assert set(batch.non_tensors()) == {
        "data_id_list",
        "rollout_id_list",
        "weight_version_min",
        "weight_version_max",
    }
    assert batch.data_id_list.dtype == object


def test_reward_stays_float32_not_bfloat16() -> None:
    batch, _ = _build(_adapter(), [_rollout([_t([1], [2, 3])], reward=0.1)])
    assert batch.token_level_scores[0, 1].item() == np.float32(0.1).item()
    assert batch.token_level_scores[0, 1].item() != torch.tensor(0.1, dtype=torch.bfloat16).item()


def test_rollouts_are_ordered_by_step_then_sample_not_completion() -> None:
    rollouts = [
        _rollout([_t([1], [2])], rollout_id="late", step=1, sample=0),
        _rollout([_t([1], [2])], rollout_id="b", step=0, sample=1),
        _rollout([_t([1], [2])], rollout_id="a", step=0, sample=0),
        _rollout([_t([1], [2])], rollout_id="a2", step=0, sample=0),
    ]
    batch, _ = _build(_adapter(), rollouts)
    assert batch.rollout_id_list.tolist() == ["a", "a2", "b", "late"]


def test_transition_rows_carry_final_reward_and_turn_index() -> None:
    triplets = [_t([1], [2, 3]), _t([1, 2, 3, 4], [5]), _t([7], [8])]
    batch, metrics = _build(_adapter("transition", p=4, r=3), [_rollout(triplets, reward=0.5)])
    assert batch.prompts.tolist() == [[PAD, PAD, PAD, 1], [1, 2, 3, 4], [PAD, PAD, PAD, 7]]
    assert batch.responses.tolist() == [[2, 3, PAD], [5, PAD, PAD], [8, PAD, PAD]]
    assert batch.response_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 0, 0]]
    assert batch.token_level_scores.tolist() == [[0.0, 0.5, 0.0], [0.5, 0.0, 0.0], [0.5, 0.0, 0.0]]
    assert batch.turn_index_list is not None
    assert batch.turn_index_list.tolist() == [0, 1, 2]
    assert batch.turn_index_list.dtype == np.int64
    assert "training/n_unmerged_rollouts" not in metrics
    assert "training/n_trace_merge_mismatch_rows" not in metrics


def test_missing_reward_is_filled_with_reward_fillna_value() -> None:
    rollouts = [_rollout([_t([1], [2])], reward=None), _rollout([_t([1], [2])], rollout_id="r2", sample=1)]
    batch, metrics = _build(_adapter(reward_fillna_value=-1.0), rollouts)
    assert batch.token_level_scores[:, 0].tolist() == [-1.0, pytest.approx(0.7)]
    assert metrics["training/n_rollouts_w_reward"] == 1
    assert metrics["training/reward"] == pytest.approx((-1.0 + 0.7) / 2)


def test_trajectory_merges_observation_with_mask_zero() -> None:
    triplets = [_t([1], [2]), _t([1, 2, 50, 51], [3]), _t([1, 2, 50, 51, 3, 60], [4, 5])]
    batch, metrics = _build(_adapter(p=2, r=8), [_rollout(triplets)])
    assert batch.responses.tolist() == [[2, 50, 51, 3, 60, 4, 5, PAD]]
    assert batch.response_mask.tolist() == [[1, 0, 0, 1, 0, 1, 1, 0]]
    assert batch.token_level_scores[0].nonzero().flatten().tolist() == [6]
    assert metrics["training/n_unmerged_rollouts"] == 0
    assert metrics["training/n_trace_merge_mismatch_rows"] == 0


def test_trajectory_merges_empty_observation() -> None:
    batch, _ = _build(_adapter(p=2, r=4), [_rollout([_t([1], [2]), _t([1, 2], [3])])])
    assert batch.responses.tolist() == [[2, 3, PAD, PAD]]
    assert batch.response_mask.tolist() == [[1, 1, 0, 0]]


def test_prefix_break_records_mismatch_entry_with_decoded_texts() -> None:
    sink = _ListSink()

    class Tok:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            assert skip_special_tokens is False
            return "".join(chr(ord("a") + i) for i in ids)

    _build(_adapter(mismatch_sink=sink, tokenizer=Tok()), [_rollout(WORKED)], global_steps=7)
    [(entries, step)] = sink.calls
    assert step == 7
    assert entries == [
        {
            "global_steps": 7,
            "rollout_id": "r1",
            "data_id": "d1",
            "turn_index": 2,
            "template_mismatch": False,
            "retoken_mismatch": False,
            "others_mismatch": True,
            "prompt_length": 1,
            "response_length": 2,
            "previous_trace_length": 7,
            "current_trace_length": 3,
            "previous_trace": "bcdefgh",
            "current_trace": "jkl",
        }
    ]


def test_mismatch_without_tokenizer_shows_ids() -> None:
    sink = _ListSink()
    _build(_adapter(mismatch_sink=sink), [_rollout(WORKED)])
    entry = sink.calls[0][0][0]
    assert (entry["previous_trace"], entry["current_trace"]) == ("1 2 3 4 5 6 7", "9 10 11")


def test_mismatch_entries_are_capped_but_counter_counts_all() -> None:
    sink = _ListSink()
    breaking = [_t([i], [100 + i]) for i in range(5)]  # every turn after the first breaks the prefix
    rollouts = [_rollout(breaking, rollout_id=f"r{j}", sample=j) for j in range(3)]
    batch, metrics = _build(_adapter(mismatch_sink=sink, max_mismatch_entries=5), rollouts)
    assert len(batch) == 15
    assert metrics["training/n_trace_merge_mismatch_rows"] == 12
    assert metrics["training/n_unmerged_rollouts"] == 3
    entries = sink.calls[0][0]
    assert [(e["rollout_id"], e["turn_index"]) for e in entries] == [
        ("r0", 1),
        ("r0", 2),
        ("r0", 3),
        ("r0", 4),
        ("r1", 1),
    ]


def test_mismatch_text_is_capped_in_length() -> None:
    sink = _ListSink()
    long_prompt = list(range(1, 30))
    triplets = [_t(long_prompt, [5]), _t([2], [3])]
    _build(_adapter(p=40, mismatch_sink=sink, max_mismatch_text_chars=10), [_rollout(triplets)])
    previous = sink.calls[0][0][0]["previous_trace"]
    full = " ".join(str(i) for i in [*long_prompt, 5])
    assert previous == full[:10] + f"\n...[truncated {len(full) - 10} chars]"


def test_no_sink_call_without_mismatches() -> None:
    sink = _ListSink()
    _build(_adapter(mismatch_sink=sink), [_rollout([_t([1], [2])])])
    assert sink.calls == []


def test_a_failing_sink_does_not_fail_the_step(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def write(self, entries: Sequence[MismatchEntry], global_steps: int) -> None:
            raise OSError("disk full")

    with caplog.at_level(logging.WARNING, logger="agl_adapter"):
        batch, _ = _build(_adapter(mismatch_sink=Broken()), [_rollout(WORKED)])
    assert len(batch) == 2
    assert "disk full" in caplog.text


def test_log_probs_concatenate_with_zero_on_observations() -> None:
    triplets = [_t([1], [2], [-0.5]), _t([1, 2, 50], [3, 4], [-0.25, -0.125])]
    batch, _ = _build(_adapter(p=2, r=6), [_rollout(triplets)])
    assert batch.rollout_log_probs is not None
    assert batch.rollout_log_probs.tolist() == [[-0.5, 0.0, -0.25, -0.125, 0.0, 0.0]]


def test_log_probs_dropped_for_row_when_one_merged_call_lacks_them(caplog: pytest.LogCaptureFixture) -> None:
    lacking = [_t([1], [2], [-0.5]), _t([1, 2, 50], [3])]
    complete = [_t([1], [2], [-0.5])]
    rollouts = [_rollout(lacking), _rollout(complete, rollout_id="r2", sample=1)]
    with caplog.at_level(logging.WARNING, logger="agl_adapter"):
        batch, _ = _build(_adapter(), rollouts)
    assert batch.rollout_log_probs is None
    assert "rollout_log_probs" not in batch.tensors()
    assert "1 of 2 rows lack log-probs" in caplog.text


def test_log_probs_of_wrong_length_drop_the_row_s_log_probs() -> None:
    bad = Triplet.model_construct(prompt_token_ids=[1], response_token_ids=[2, 3], response_log_probs=[-0.5])
    batch, _ = _build(_adapter(), [_unchecked(_rollout([]), [bad])])
    assert batch.rollout_log_probs is None


def test_no_log_probs_anywhere_means_no_key_and_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="agl_adapter"):
        batch, _ = _build(_adapter(), [_rollout([_t([1], [2])])])
    assert batch.rollout_log_probs is None
    assert caplog.text == ""


def test_prompt_overflow_keeps_head_and_flags_drop() -> None:
    batch, _ = _build(_adapter(p=6), [_rollout([_t([1, 2, 3, 4, 5, 6, 7], [8])])])
    assert batch.prompts.tolist() == [[1, 2, 3, 4, 5, 6]]
    assert batch.is_drop_mask.tolist() == [True]
    assert batch.position_ids[0, :8].tolist() == [0, 1, 2, 3, 4, 5, 6, 6]


def test_response_overflow_keeps_head_and_is_counted() -> None:
    triplets = [_t([1], [2, 3], [-1.0, -2.0]), _t([1, 2, 3, 50, 51], [4, 5], [-3.0, -4.0])]
    batch, metrics = _build(_adapter(p=2, r=5), [_rollout(triplets, reward=1.0)])
    assert batch.responses.tolist() == [[2, 3, 50, 51, 4]]
    assert batch.response_mask.tolist() == [[1, 1, 0, 0, 1]]
    assert batch.rollout_log_probs is not None
    assert batch.rollout_log_probs.tolist() == [[-1.0, -2.0, 0.0, 0.0, -3.0]]
    assert batch.token_level_scores.tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0]]
    assert metrics["training/n_truncated_sample"] == 1
    assert batch.is_drop_mask.tolist() == [False]


def test_empty_response_rows_are_skipped_and_counted() -> None:
    triplets = [_t([1], []), _t([5], [6])]
    batch, metrics = _build(_adapter("transition"), [_rollout(triplets)])
    assert batch.responses[:, 0].tolist() == [6]
    assert batch.turn_index_list is not None
    assert batch.turn_index_list.tolist() == [1]
    assert metrics["training/n_skipped_empty_rows"] == 1
    assert metrics["training/n_empty_response_triplets"] == 1
    assert metrics["training/n_turns"] == 2


def test_trajectory_row_without_model_tokens_is_skipped() -> None:
    # the first row holds only an empty response; the second starts a new row after a prefix break
    triplets = [_t([1], []), _t([1, 7], []), _t([3], [4])]
    batch, metrics = _build(_adapter(), [_rollout(triplets)])
    assert batch.responses[:, 0].tolist() == [4]
    assert metrics["training/n_skipped_empty_rows"] == 1
    assert metrics["training/n_empty_response_triplets"] == 2


def test_observation_only_row_after_truncation_is_skipped() -> None:
    # model tokens sit past max_response_length, so nothing trainable is left
    triplets = [_t([1], []), _t([1, 50, 51, 52], [4])]
    _, metrics_kept = _build(_adapter(r=4), [_rollout(triplets), _rollout([_t([1], [2])], sample=1)])
    assert metrics_kept["training/n_skipped_empty_rows"] == 0
    _, metrics = _build(_adapter(r=3), [_rollout(triplets), _rollout([_t([1], [2])], sample=1)])
    assert metrics["training/n_skipped_empty_rows"] == 1
    assert metrics["training/n_sample"] == 1


def test_zero_rows_is_an_error_that_says_why() -> None:
    rollouts = [_rollout([]), _rollout([_t([1], [])], rollout_id="r2", sample=1)]
    with pytest.raises(
        EmptyBatchError, match="zero training rows: 2 rollouts, 0 dropped as failed, 1 without"
    ):
        _build(_adapter(), rollouts)


def test_unknown_level_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="Unknown trace_aggregator_level: 'step'; supported: "):
        _adapter("step")


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_prompt_length", 0), ("max_response_length", -1), ("pad_token_id", -1), ("max_prompt_length", 2.0)],
)
def test_bad_widths_are_value_errors_naming_the_field(field: str, value: object) -> None:
    kwargs: dict[str, Any] = {"max_prompt_length": 4, "max_response_length": 4, "pad_token_id": 0}
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        RolloutAdapter(**kwargs)


def test_ids_of_wrong_type_name_the_rollout_and_turn() -> None:
    bad = Triplet.model_construct(prompt_token_ids=[1, 2.5], response_token_ids=[3])
    with pytest.raises(InvalidTraceError, match=r"rollout 'rX' turn 1: prompt_token_ids must hold int"):
        _build(_adapter(), [_unchecked(_rollout([], rollout_id="rX"), [_t([1], [2]), bad])])


def test_response_ids_of_wrong_type_name_the_field() -> None:
    bad = Triplet.model_construct(prompt_token_ids=[1], response_token_ids=["a"])
    with pytest.raises(InvalidTraceError, match=r"turn 0: response_token_ids"):
        _build(_adapter("transition"), [_unchecked(_rollout([]), [bad])])


def test_ids_beyond_int64_name_the_rollout_and_turn() -> None:
    bad = Triplet.model_construct(prompt_token_ids=[1, 2**63], response_token_ids=[3])
    with pytest.raises(InvalidTraceError, match=r"rollout 'rX' turn 0: prompt_token_ids must hold int"):
        _build(_adapter(), [_unchecked(_rollout([], rollout_id="rX"), [bad])])


def test_log_probs_of_wrong_type_name_the_rollout_and_turn() -> None:
    bad = Triplet.model_construct(prompt_token_ids=[1], response_token_ids=[3], response_log_probs=["x"])
    with pytest.raises(InvalidTraceError, match=r"rollout 'rX' turn 1: response_log_probs must hold floats"):
        _build(_adapter("transition"), [_unchecked(_rollout([], rollout_id="rX"), [_t([1], [2]), bad])])


def test_input_triplets_are_not_mutated() -> None:
    triplets = [_t([1], [2], [-0.5]), _t([1, 2, 50], [3], [-0.25])]
    rollout = _rollout(triplets)
    before = rollout.model_dump()
    batch, _ = _build(_adapter(), [rollout])
    batch.responses.fill_(0)
    assert rollout.model_dump() == before


def test_failed_rollouts_are_trained_by_default_and_counted() -> None:
    rollouts = [
        _rollout([_t([1], [2])], reward=None, state=RolloutState.FAILED),
        _rollout([_t([1], [3])], rollout_id="r2", sample=1, reward=1.0),
    ]
    batch, metrics = _build(_adapter(), rollouts)
    assert len(batch) == 2
    assert metrics["training/n_failed_rollouts"] == 1
    assert metrics["training/n_dropped_failed_rollouts"] == 0


def test_drop_failed_rollouts_emits_no_rows_for_them() -> None:
    rollouts = [
        _rollout([_t([1], [2])], reward=None, state=RolloutState.FAILED),
        _rollout([_t([1], [2])], rollout_id="t", sample=1, state=RolloutState.FAILED, timed_out=True),
        _rollout([_t([1], [3])], rollout_id="ok", sample=2, reward=1.0),
    ]
    batch, metrics = _build(_adapter(drop_failed_rollouts=True), rollouts)
    assert batch.rollout_id_list.tolist() == ["ok"]
    assert metrics["training/n_failed_rollouts"] == 2
    assert metrics["training/n_dropped_failed_rollouts"] == 2
    assert metrics["training/n_rollouts"] == 3
    assert metrics["training/reward"] == 1.0


def test_all_failed_and_dropped_is_an_error_that_says_so() -> None:
    rollouts = [_rollout([_t([1], [2])], state=RolloutState.FAILED)]
    with pytest.raises(EmptyBatchError, match="1 dropped as failed"):
        _build(_adapter(drop_failed_rollouts=True), rollouts)


def test_training_metrics_have_the_verl_names_and_values() -> None:
    rollouts = [
        _rollout(WORKED, reward=1.0),
        _rollout([], rollout_id="empty", sample=1, reward=None),
        _rollout([_t([1], [2, 3, 4, 5, 6, 7, 8, 9, 10])], rollout_id="long", sample=2, reward=0.0),
    ]
    _, metrics = _build(_adapter(), rollouts)
    assert metrics == {
        "training/reward": pytest.approx(1.0 / 3),
        "training/n_sample": 3,
        "training/n_rollouts": 3,
        "training/n_rollouts_w_trace": 2,
        "training/n_rollouts_w_reward": 2,
        "training/n_failed_rollouts": 0,
        "training/n_dropped_failed_rollouts": 0,
        "training/n_truncated_sample": 1,
        "training/n_skipped_empty_rows": 0,
        "training/n_empty_response_triplets": 0,
        "training/n_turns": 4,
        "response_length/training/avg_by_turn": pytest.approx((2 + 1 + 2 + 9) / 4),
        "response_length/training/max_by_turn": 9,
        "response_length/training/min_by_turn": 1,
        "training/n_unmerged_rollouts": 1,
        "training/n_trace_merge_mismatch_rows": 1,
    }


def test_test_metrics_average_over_rollouts() -> None:
    rollouts = [
        _rollout([_t([1], [2, 3]), _t([1], [4, 5, 6, 7])], reward=1.0),
        _rollout([_t([1], [2])], rollout_id="r2", sample=1, reward=None),
        _rollout([], rollout_id="r3", sample=2, reward=0.5),
    ]
    metrics = _adapter().get_test_metrics(rollouts)
    assert metrics == {
        "val/reward": pytest.approx(1.5 / 3),
        "val/n_rollouts": 3,
        "val/n_rollouts_w_trace": 2,
        "val/n_rollouts_w_reward": 2,
        "val/mean_response_length_per_turn": pytest.approx((3.0 + 1.0) / 2),
        "val/mean_total_response_length_per_rollout": pytest.approx((6 + 1) / 2),
        "val/turn_count": pytest.approx(1.5),
    }


def test_test_metrics_without_traces_is_an_error() -> None:
    with pytest.raises(EmptyBatchError, match="zero completed rollouts with trace"):
        _adapter().get_test_metrics([_rollout([])])


def test_get_train_data_batch_gives_adapter_batch_without_verl(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "verl" else real_find_spec(name, *a)
    )
    batch, metrics = _adapter().get_train_data_batch([_rollout(WORKED)])
    assert isinstance(batch, AdapterBatch)
    assert metrics["training/n_sample"] == 2


def test_to_data_proto_without_verl_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    batch, _ = _build(_adapter(), [_rollout(WORKED)])
    monkeypatch.setitem(sys.modules, "verl", None)
    with pytest.raises(ImportError, match=r"pip install 'agl-adapter\[verl\]'"):
        batch.to_data_proto()


def test_device_moves_every_tensor() -> None:
    batch, _ = _build(_adapter(device="meta"), [_rollout(WORKED)])
    assert {t.device.type for t in batch.tensors().values()} == {"meta"}
