"""Where a training step of the embedded default spends its time, from a real run's metrics.

Runs ``agl-trainer`` (the embedded default) unless ``--metrics`` points at an existing run's
``metrics.jsonl``, then prints the median seconds per phase, each phase's share of the step, the
server requests per rollout, and the share the learning side adds on top of generation and the
update (adapter + advantage + gateway drain).

    .venv/bin/python benchmarks/bench_step.py [--metrics PATH] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

PHASES = ("gen", "adapter", "old_log_prob", "adv", "update_actor", "update_weights")
LEARNING_SIDE = ("timing_s/adapter", "timing_s/adv", "training/async/proxy_drain_seconds")


def _latest_run_metrics() -> Path:
    from agl_trainer.local import cache_dir

    runs = sorted((cache_dir() / "runs").glob("*/metrics.jsonl"))
    if not runs:
        raise SystemExit("no run found; run agl-trainer first or pass --metrics")
    return runs[-1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--metrics", type=Path)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    path = args.metrics
    if path is None:
        subprocess.run(
            [sys.executable, "-m", "agl_trainer.cli", f"trainer.total_training_steps={args.steps}"],
            check=True,
        )
        path = _latest_run_metrics()
    rows = [json.loads(line)["data"] for line in path.read_text().splitlines()]
    steps = rows[1:] if len(rows) > 1 else rows  # the first step pays one-off warm-up costs
    median = {key: statistics.median(r[key] for r in steps if key in r) for key in steps[-1]}
    step_s = median["timing_s/step"]
    print(f"run: {path} ({len(steps)} steps after the first)")
    print(f"{'phase':<16}{'median s':>10}{'share':>8}")
    for phase in PHASES:
        seconds = median.get(f"timing_s/{phase}", 0.0)
        print(f"{phase:<16}{seconds:>10.4f}{seconds / step_s:>8.1%}")
    print(f"{'step':<16}{step_s:>10.4f}{1:>8.0%}")
    learning = sum(median.get(key, 0.0) for key in LEARNING_SIDE)
    print(
        f"server requests per rollout: {median.get('training/server_requests_per_rollout', float('nan')):.2f}"
    )
    print(
        f"learning side on top of generation and update: {learning:.4f} s = {learning / step_s:.2%} of the step"
    )


if __name__ == "__main__":
    main()
