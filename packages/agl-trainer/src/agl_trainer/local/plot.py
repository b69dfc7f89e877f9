"""A PNG of what a user of the embedded default looks at, from the JSONL verl's ``file`` logger writes:
reward with validation reward, the step time split into waiting, training and pushing, and, in
fully-async mode, staleness. The policy loss is left out: GRPO's is zero in expectation, so its
curve is noise around 0."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agl_trainer.local.console import step_time_split

Series = list[tuple[int, float]]
Records = list[tuple[int, dict[str, Any]]]


@dataclass(frozen=True)
class Panel:
    """One panel: a title and its curves, ``(label, [(step, value), ...])`` each, empty ones left
    out; a ``stacked`` panel draws its curves as bars on top of each other (parts of a whole)."""

    title: str
    curves: tuple[tuple[str, Series], ...]
    stacked: bool = False


def _series(records: Records, key: str) -> Series:
    return [(step, float(data[key])) for step, data in records if isinstance(data.get(key), int | float)]


def _time_panel(records: Records) -> Panel:
    splits = [(step, split) for step, data in records if (split := step_time_split(data)) is not None]
    curves = tuple(
        (label, [(step, split[index]) for step, split in splits])
        for index, label in enumerate(("waiting", "training", "pushing"))
    )
    return Panel("step time (s)", curves, stacked=True)


def read_panels(jsonl: Path, *, fully_async: bool) -> list[Panel]:
    """The panels of the plot of ``jsonl``: reward, step time, and staleness when ``fully_async``."""
    records: Records = []
    for line in jsonl.read_text().splitlines():
        record = json.loads(line)
        records.append((int(record["step"]), record["data"]))
    reward = (
        ("training", _series(records, "training/reward")),
        ("validation", _series(records, "val/reward")),
    )
    panels = [Panel("reward", reward), _time_panel(records)]
    if fully_async:
        staleness = (
            ("max", _series(records, "training/async/staleness_max")),
            ("mean", _series(records, "training/async/staleness_mean")),
        )
        panels.append(Panel("staleness (weight versions)", staleness))
    return [dataclasses.replace(panel, curves=tuple(c for c in panel.curves if c[1])) for panel in panels]


def _draw(axis: Any, panel: Panel) -> None:
    from matplotlib.ticker import MaxNLocator

    bottoms: dict[int, float] = {}
    for label, points in panel.curves:
        steps, values = [s for s, _ in points], [v for _, v in points]
        if panel.stacked:
            below = [bottoms.get(s, 0.0) for s in steps]
            axis.bar(steps, values, bottom=below, label=label)
            bottoms.update({s: b + v for s, b, v in zip(steps, below, values, strict=True)})
        else:
            axis.plot(steps, values, marker="o", label=label)
    axis.set_xlabel("step")
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set_title(panel.title)
    axis.grid(alpha=0.3)
    if panel.curves:
        axis.legend()


def plot_metrics(jsonl: Path, png: Path, *, fully_async: bool = False) -> Path:
    """Draw :func:`read_panels` of ``jsonl`` side by side into ``png`` and return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = read_panels(jsonl, fully_async=fully_async)
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for axis, panel in zip(axes[0], panels, strict=True):
        _draw(axis, panel)
    figure.tight_layout()
    figure.savefig(png, dpi=100)
    plt.close(figure)
    return png


__all__ = ("Panel", "plot_metrics", "read_panels")
