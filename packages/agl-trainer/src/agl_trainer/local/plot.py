"""A PNG of reward and loss per step, from the JSONL that verl's ``file`` logger writes."""

from __future__ import annotations

import json
from pathlib import Path

CURVES = (("training/reward", "reward"), ("actor/pg_loss", "policy loss"), ("actor/grad_norm", "grad norm"))


def read_metrics(jsonl: Path) -> dict[str, list[tuple[int, float]]]:
    """``{metric: [(step, value), ...]}`` for the plotted metrics present in ``jsonl``."""
    series: dict[str, list[tuple[int, float]]] = {key: [] for key, _ in CURVES}
    for line in jsonl.read_text().splitlines():
        record = json.loads(line)
        for key in series:
            value = record["data"].get(key)
            if isinstance(value, int | float):
                series[key].append((int(record["step"]), float(value)))
    return series


def plot_metrics(jsonl: Path, png: Path) -> Path:
    """Draw reward and policy loss against step into ``png`` and return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = read_metrics(jsonl)
    figure, axes = plt.subplots(1, len(CURVES), figsize=(10, 4))
    for axis, (key, label) in zip(axes, CURVES, strict=True):
        points = series[key]
        axis.plot([s for s, _ in points], [v for _, v in points], marker="o")
        axis.set_xlabel("step")
        axis.set_title(label)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(png, dpi=100)
    plt.close(figure)
    return png


__all__ = ("CURVES", "plot_metrics", "read_metrics")
