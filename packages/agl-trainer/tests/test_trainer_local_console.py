"""The embedded default's compact console: the line per step, and following metrics.jsonl as verl writes it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agl_trainer.local.console import MetricsFollower, compact_console, step_line

# From a real sync run's metrics.jsonl (step 2 of 3, validated), less the metrics the line ignores.
SYNC_STEP: dict[str, Any] = {
    "training/reward": 0.0859375,
    "val/reward": 0.0703125,
    "timing_s/testing": 2.117005964000782,
    "timing_s/step": 2.708242964999954,
    "timing_s/gen": 0.9315666519996739,
    "timing_s/update_weights": 0.13772920700102986,
    "training/n_rollouts_succeeded": 16.0,
    "training/n_rollouts_failed": 0.0,
    "training/n_rollouts_timed_out": 0.0,
    "training/async/staleness_max": 0.0,
    "training/async/staleness_mean": 0.0,
    "actor/pg_loss": 5.587935447692871e-09,
}


def _record(step: int, data: dict[str, Any]) -> bytes:
    return (json.dumps({"step": step, "data": data}) + "\n").encode()


def test_step_line_has_reward_validation_time_split_and_failed_rollouts() -> None:
    assert step_line(2, SYNC_STEP, total_steps=25, fully_async=False) == (
        "step  2/25  reward 0.086  val 0.070 (2.1 s)  time 2.7 s = wait 0.9 + train 1.6 + push 0.1  rollouts 16 ok, 0 failed"
    )


def test_step_line_shows_staleness_in_fully_async_mode_and_counts_timed_out_rollouts_as_failed() -> None:
    data = {
        **SYNC_STEP,
        "training/async/staleness_max": 2.0,
        "training/async/staleness_mean": 0.75,
        "training/n_rollouts_failed": 1.0,
        "training/n_rollouts_timed_out": 2.0,
    }
    del data["val/reward"]
    assert step_line(12, data, total_steps=25, fully_async=True) == (
        "step 12/25  reward 0.086  time 2.7 s = wait 0.9 + train 1.6 + push 0.1  staleness max 2 mean 0.8  rollouts 16 ok, 3 failed"
    )


def test_step_line_of_a_validation_before_training_has_only_the_validation() -> None:
    data = {"val/reward": 0.0703125, "val/n_rollouts": 32}
    assert step_line(0, data, total_steps=25, fully_async=True) == "step  0/25  val 0.070"


def test_follower_hands_on_each_complete_record_once_and_waits_for_a_partly_written_one(
    tmp_path: Path,
) -> None:
    jsonl = tmp_path / "metrics.jsonl"
    seen: list[tuple[int, dict[str, Any]]] = []
    follower = MetricsFollower(jsonl, lambda step, data: seen.append((step, dict(data))))
    follower.poll()
    second = _record(2, {"training/reward": 0.5})
    jsonl.write_bytes(_record(1, {"training/reward": 0.25}) + second[:10])
    follower.poll()
    with jsonl.open("ab") as file:
        file.write(second[10:])
    follower.poll()
    follower.poll()
    assert seen == [(1, {"training/reward": 0.25}), (2, {"training/reward": 0.5})]


def test_compact_console_writes_one_line_per_logged_step(tmp_path: Path) -> None:
    jsonl = tmp_path / "metrics.jsonl"
    lines: list[str] = []
    with compact_console(jsonl, loggers=["file"], total_steps=25, fully_async=False, write=lines.append):
        jsonl.write_bytes(_record(1, {"training/reward": 0.25}) + _record(2, {"training/reward": 0.5}))
    assert lines == ["step  1/25  reward 0.250", "step  2/25  reward 0.500"]


def test_compact_console_stays_quiet_when_verl_console_logger_is_chosen(tmp_path: Path) -> None:
    jsonl = tmp_path / "metrics.jsonl"
    lines: list[str] = []
    with compact_console(
        jsonl, loggers=["console", "file"], total_steps=25, fully_async=False, write=lines.append
    ):
        jsonl.write_bytes(_record(1, {"training/reward": 0.25}))
    assert lines == []
