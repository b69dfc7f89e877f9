"""The embedded default's plot: its panels read from a metrics file, and the PNG drawn from them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agl_trainer.local.plot import Panel, plot_metrics, read_panels

RECORDS: list[dict[str, Any]] = [
    {
        "step": 1,
        "data": {
            "training/reward": 0.25,
            "timing_s/step": 4.0,
            "timing_s/gen": 3.0,
            "timing_s/update_weights": 0.25,
            "training/async/staleness_max": 0.0,
            "training/async/staleness_mean": 0.0,
            "actor/pg_loss": 1e-9,
        },
    },
    {
        "step": 2,
        "data": {
            "training/reward": 0.5,
            "val/reward": 0.375,
            "timing_s/step": 2.5,
            "timing_s/gen": 1.0,
            "timing_s/update_weights": 0.5,
            "training/async/staleness_max": 2.0,
            "training/async/staleness_mean": 0.5,
        },
    },
]


def _metrics_file(tmp_path: Path) -> Path:
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    return jsonl


def test_panels_are_reward_with_validation_and_the_step_time_split(tmp_path: Path) -> None:
    assert read_panels(_metrics_file(tmp_path), fully_async=False) == [
        Panel("reward", (("training", [(1, 0.25), (2, 0.5)]), ("validation", [(2, 0.375)]))),
        Panel(
            "step time (s)",
            (
                ("waiting", [(1, 3.0), (2, 1.0)]),
                ("training", [(1, 0.75), (2, 1.0)]),
                ("pushing", [(1, 0.25), (2, 0.5)]),
            ),
            stacked=True,
        ),
    ]


def test_fully_async_plot_adds_a_staleness_panel(tmp_path: Path) -> None:
    assert read_panels(_metrics_file(tmp_path), fully_async=True)[2] == Panel(
        "staleness (weight versions)", (("max", [(1, 0.0), (2, 2.0)]), ("mean", [(1, 0.0), (2, 0.5)]))
    )


def test_plot_is_a_png(tmp_path: Path) -> None:
    png = plot_metrics(_metrics_file(tmp_path), tmp_path / "progress.png", fully_async=True)
    assert png == tmp_path / "progress.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
