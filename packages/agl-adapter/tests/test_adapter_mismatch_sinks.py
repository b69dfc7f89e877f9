"""Where trace-merge mismatch entries go: log, JSONL file, wandb table, and the default choice."""

from __future__ import annotations

import json
import logging
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from agl_adapter import (
    MISMATCH_COLUMNS,
    JsonlMismatchSink,
    LogMismatchSink,
    MismatchEntry,
    WandbMismatchSink,
    default_mismatch_sink,
)


def _entry(turn: int = 1, text: str = "ü") -> MismatchEntry:
    return MismatchEntry(
        global_steps=3,
        rollout_id="r1",
        data_id="d1",
        turn_index=turn,
        template_mismatch=False,
        retoken_mismatch=False,
        others_mismatch=True,
        prompt_length=1,
        response_length=2,
        previous_trace_length=3,
        current_trace_length=4,
        previous_trace=text,
        current_trace="b",
    )


class _FakeTable:
    def __init__(self, columns: list[str]) -> None:
        self.columns = columns
        self.rows: list[tuple[Any, ...]] = []

    def add_data(self, *values: Any) -> None:
        self.rows.append(values)


def _fake_wandb(run: object | None) -> types.SimpleNamespace:
    logged: list[tuple[dict[str, Any], int]] = []
    return types.SimpleNamespace(
        run=run, Table=_FakeTable, log=lambda data, step: logged.append((data, step)), logged=logged
    )


def test_jsonl_sink_appends_one_json_line_per_entry(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "mismatches.jsonl"
    sink = JsonlMismatchSink(path)
    sink.write([_entry(1)], 3)
    sink.write([_entry(2)], 4)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["turn_index"] for line in lines] == [1, 2]
    assert "ü" in lines[0]


def test_log_sink_logs_summary_and_entries(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="agl_adapter"):
        LogMismatchSink().write([_entry(1), _entry(2)], 5)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "step 5: 2 trace-merge mismatch entries"
    assert json.loads(messages[1].removeprefix("trace-merge mismatch: "))["turn_index"] == 1
    assert len(messages) == 3


def test_wandb_sink_logs_a_table_with_the_reference_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = _fake_wandb(run=object())
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    WandbMismatchSink().write([_entry(1)], 9)
    [(data, step)] = wandb.logged
    table = data["training/trace_merge_mismatches"]
    assert step == 9
    assert table.columns == list(MISMATCH_COLUMNS)
    assert table.rows == [(3, "r1", "d1", 1, False, False, True, 1, 2, 3, 4, "ü", "b")]


def test_wandb_sink_without_run_logs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = _fake_wandb(run=None)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    WandbMismatchSink().write([_entry(1)], 9)
    assert wandb.logged == []


def test_default_sink_is_wandb_only_with_an_active_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    assert isinstance(default_mismatch_sink(), LogMismatchSink)
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(run=None))
    assert isinstance(default_mismatch_sink(), LogMismatchSink)
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(run=object()))
    assert isinstance(default_mismatch_sink(), WandbMismatchSink)
