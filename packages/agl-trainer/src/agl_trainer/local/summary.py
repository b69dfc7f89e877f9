"""What a finished run did, from its ``metrics.jsonl`` (verl's ``file`` logger): the end summary."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_COUNTS = {
    "samples_trained": "training/n_sample_trained",
    "succeeded": "training/n_rollouts_succeeded",
    "failed": "training/n_rollouts_failed",
    "timed_out": "training/n_rollouts_timed_out",
}
"""The per-step counts summed over the run (agl-rollout's and agl-algos' metric names)."""


@dataclass(frozen=True)
class RunTotals:
    """Training rollouts and samples of a run, summed over its steps."""

    steps: int = 0
    samples_trained: int = 0
    succeeded: int = 0
    failed: int = 0
    timed_out: int = 0

    @classmethod
    def read(cls, metrics: Path) -> RunTotals:
        """Sum ``metrics`` (one ``{"step": N, "data": {...}}`` a line); zeros when it does not exist."""
        sums = dict.fromkeys(_COUNTS, 0)
        steps: set[int] = set()
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        for line in filter(str.strip, lines):
            record = json.loads(line)
            data = record.get("data", {})
            if _COUNTS["samples_trained"] not in data and _COUNTS["succeeded"] not in data:
                continue  # a validation-only record
            steps.add(int(record["step"]))
            for field, key in _COUNTS.items():
                sums[field] += int(data.get(key, 0))
        return cls(steps=len(steps), **sums)

    def line(self) -> str:
        """``15 steps: 0 samples trained; rollouts: 0 succeeded, 240 failed, 0 timed out``."""
        return (
            f"{self.steps} steps: {self.samples_trained} samples trained; rollouts: {self.succeeded} "
            f"succeeded, {self.failed} failed, {self.timed_out} timed out"
        )


__all__ = ("RunTotals",)
