"""Where trace-merge mismatch entries go: log and JSONL file (wandb: test_adapter_wandb.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from agl_adapter import (
    JsonlMismatchSink,
    LogMismatchSink,
    MismatchEntry,
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
