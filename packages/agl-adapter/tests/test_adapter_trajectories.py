"""Per-step trajectory artifacts: the records, the zipped JSON-lines files, and what the adapter writes."""

from __future__ import annotations

import json
import logging
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from agl_adapter import (
    EmptyBatchError,
    MismatchEntry,
    RolloutAdapter,
    ZippedJsonlArtifacts,
)
from agl_types import CompletedRollout, RolloutState, Triplet


def _t(prompt: list[int], response: list[int]) -> Triplet:
    return Triplet(prompt_token_ids=prompt, response_token_ids=response)


BROKEN = [_t([1, 2], [3, 4]), _t([1, 2, 3, 4, 5, 6], [7]), _t([9], [10, 11])]
"""Three turns; the third does not continue the second (a prefix break)."""
CONTINUED = [_t([1], [2]), _t([1, 2, 8], [5])]


def _rollout(
    triplets: Sequence[Triplet],
    rollout_id: str,
    *,
    sample: int = 0,
    step: int = 0,
    reward: float | None = 0.5,
    state: RolloutState = RolloutState.SUCCEEDED,
    error: str | None = None,
) -> CompletedRollout:
    return CompletedRollout(
        rollout_id=rollout_id,
        data_id=f"d-{rollout_id}",
        step=step,
        sample_idx_in_step=sample,
        enqueue_time=0.0,
        final_reward=reward,
        triplets=list(triplets),
        rollout_state=state,
        error_message=error,
    )


class _Letters:
    """Decodes id i as the i-th lower-case letter."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


class _Discard:
    def write(self, entries: Sequence[MismatchEntry], global_steps: int) -> None:
        pass


def _adapter(folder: Path, level: str = "trajectory", **kwargs: Any) -> RolloutAdapter:
    return RolloutAdapter(
        max_prompt_length=8,
        max_response_length=8,
        pad_token_id=0,
        trace_aggregator_level=level,
        reward_fillna_value=-1.0,
        tokenizer=_Letters(),
        mismatch_sink=_Discard(),
        artifact_sink=ZippedJsonlArtifacts(folder),
        **kwargs,
    )


def _read(path: Path) -> list[dict[str, Any]]:
    with zipfile.ZipFile(path) as archive:
        assert archive.namelist() == [path.name.removesuffix(".zip")]
        text = archive.read(archive.namelist()[0]).decode("utf-8")
    return [json.loads(line) for line in text.splitlines()]


def test_a_training_step_writes_one_record_per_rollout_as_zipped_jsonl(tmp_path: Path) -> None:
    failed = _rollout([], "r2", sample=1, reward=None, state=RolloutState.FAILED, error="agent crashed")
    _adapter(tmp_path).build_batch([failed, _rollout(CONTINUED, "r1")], global_steps=3)
    assert _read(tmp_path / "step_3" / "train_trajectories.jsonl.zip") == [
        {
            "global_steps": 3,
            "rollout_id": "r1",
            "data_id": "d-r1",
            "state": "succeeded",
            "error_message": None,
            "reward": 0.5,
            "has_reward": True,
            "n_turns": 2,
            "prompt_ids": [1, 2, 8],
            "response_ids": [5],
            "prompt": "bci",
            "response": "f",
            "mismatch": "none",
        },
        {
            "global_steps": 3,
            "rollout_id": "r2",
            "data_id": "d-r2",
            "state": "failed",
            "error_message": "agent crashed",
            "reward": -1.0,
            "has_reward": False,
            "n_turns": 0,
            "prompt_ids": [],
            "response_ids": [],
            "prompt": "",
            "response": "",
            "mismatch": "none",
        },
    ]
    assert not (tmp_path / "step_3" / "trace_merge_mismatches.jsonl.zip").exists()


def test_a_rollout_whose_turns_break_the_merge_is_marked_and_the_entries_are_written_beside(
    tmp_path: Path,
) -> None:
    _adapter(tmp_path).build_batch(
        [_rollout(BROKEN, "r1"), _rollout(CONTINUED, "r2", sample=1)], global_steps=1
    )
    records = _read(tmp_path / "step_1" / "train_trajectories.jsonl.zip")
    assert [(r["rollout_id"], r["mismatch"]) for r in records] == [("r1", "others"), ("r2", "none")]
    [entry] = _read(tmp_path / "step_1" / "trace_merge_mismatches.jsonl.zip")
    assert (entry["rollout_id"], entry["turn_index"], entry["current_trace"]) == ("r1", 2, "jkl")


def test_transition_level_attempts_no_merge_and_marks_no_mismatch_class(tmp_path: Path) -> None:
    _adapter(tmp_path, level="transition").build_batch([_rollout(BROKEN, "r1")], global_steps=1)
    [record] = _read(tmp_path / "step_1" / "train_trajectories.jsonl.zip")
    assert record["mismatch"] is None
    assert not (tmp_path / "step_1" / "trace_merge_mismatches.jsonl.zip").exists()


def test_training_records_are_capped_in_step_and_sample_order(tmp_path: Path) -> None:
    rollouts = [
        _rollout(CONTINUED, f"s{step}-{sample}", step=step, sample=sample)
        for step in (1, 0)
        for sample in (1, 0)
    ]
    _adapter(tmp_path, max_train_trajectories=3).build_batch(rollouts, global_steps=2)
    records = _read(tmp_path / "step_2" / "train_trajectories.jsonl.zip")
    assert [r["rollout_id"] for r in records] == ["s0-0", "s0-1", "s1-0"]


def test_validation_writes_every_rollout_with_no_mismatch_class(tmp_path: Path) -> None:
    rollouts = [_rollout(BROKEN, f"v{i}", sample=i, reward=float(i)) for i in range(30)]
    _adapter(tmp_path, max_train_trajectories=3).get_test_metrics(rollouts, global_steps=4)
    records = _read(tmp_path / "step_4" / "validation_trajectories.jsonl.zip")
    assert [(r["rollout_id"], r["reward"], r["mismatch"]) for r in records] == [
        (f"v{i}", float(i), None) for i in range(30)
    ]


def test_a_validation_without_any_trace_still_writes_its_records_before_it_raises(tmp_path: Path) -> None:
    failed = _rollout([], "v1", reward=None, state=RolloutState.FAILED, error="agent crashed")
    with pytest.raises(EmptyBatchError):
        _adapter(tmp_path).get_test_metrics([failed], global_steps=2)
    [record] = _read(tmp_path / "step_2" / "validation_trajectories.jsonl.zip")
    assert (record["rollout_id"], record["error_message"]) == ("v1", "agent crashed")


def test_a_step_with_no_trainable_rows_still_writes_its_trajectories(tmp_path: Path) -> None:
    failed = _rollout([], "r1", reward=None, state=RolloutState.FAILED, error="timed out")
    with pytest.raises(EmptyBatchError):
        _adapter(tmp_path).build_batch([failed], global_steps=5)
    [record] = _read(tmp_path / "step_5" / "train_trajectories.jsonl.zip")
    assert (record["rollout_id"], record["error_message"]) == ("r1", "timed out")


def test_a_failing_artifact_sink_costs_the_step_nothing_but_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class DiskFull:
        def write(self, kind: str, records: Sequence[Mapping[str, Any]], global_steps: int) -> None:
            raise OSError("No space left on device")

    adapter = _adapter(tmp_path)
    adapter.artifact_sink = DiskFull()
    with caplog.at_level(logging.WARNING, logger="agl_adapter"):
        batch, _ = adapter.build_batch([_rollout(CONTINUED, "r1")], global_steps=6)
    assert len(batch) == 1
    assert "step 6: failed to write train_trajectories" in caplog.text
    assert "No space left on device" in caplog.text


def test_without_an_artifact_sink_nothing_is_written(tmp_path: Path) -> None:
    adapter = _adapter(tmp_path)
    adapter.artifact_sink = None
    adapter.build_batch([_rollout(BROKEN, "r1")], global_steps=1)
    adapter.get_test_metrics([_rollout(BROKEN, "r1")], global_steps=1)
    assert list(tmp_path.iterdir()) == []


def test_record_text_is_cut_at_max_mismatch_text_chars(tmp_path: Path) -> None:
    long_prompt = [_t(list(range(1, 21)), [2])]
    _adapter(tmp_path, max_mismatch_text_chars=5).build_batch([_rollout(long_prompt, "r1")], global_steps=1)
    [record] = _read(tmp_path / "step_1" / "train_trajectories.jsonl.zip")
    full = "".join(chr(ord("a") + i) for i in range(1, 21))
    assert record["prompt"] == full[:5] + f"\n...[truncated {len(full) - 5} chars]"
    assert record["prompt_ids"] == list(range(1, 21))  # the ids are never cut


@pytest.mark.parametrize(("limit", "expected"), [(None, 5), (0, 0)])
def test_max_train_trajectories_none_writes_all_and_zero_writes_an_empty_file(
    tmp_path: Path, limit: int | None, expected: int
) -> None:
    rollouts = [_rollout(CONTINUED, f"r{i}", sample=i) for i in range(5)]
    _adapter(tmp_path, max_train_trajectories=limit).build_batch(rollouts, global_steps=1)
    assert len(_read(tmp_path / "step_1" / "train_trajectories.jsonl.zip")) == expected


def test_a_negative_max_train_trajectories_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_train_trajectories must be a non-negative int, got -1"):
        _adapter(tmp_path, max_train_trajectories=-1)
