"""Where a training step of the embedded default spends its time, measured on a fresh run.

Runs the embedded default (CPU) in this process for ``--steps`` steps with timers around the parts
of a step that verl's ``timing_s/*`` leave out, then prints, as medians over the steps after the
first (which pays one-off warm-up costs):

- seconds and share of the step per phase (collection, adapter, log-probs, advantage, update,
  weight push), and the server requests per rollout;
- the learning side's own time on the step's critical path: within collection, enqueueing
  (from the start of collection until the rollouts are created) and the tail (from the last
  rollout's end on the server until collection returns: seeing it, fetching its events, deleting
  it, draining the gateway); then the adapter, the advantage with the per-rollout normalisation,
  the batch cut with ``to_data_proto`` (the trainer's own timers), and whatever no timer covers;
- that share against the goal (under 5% of the step), PASS or FAIL (exit status 1);
- as an upper bound, the rollout manager's whole busy time in collection (collection minus the
  main thread's sleeps while it waits for agents): most of it overlaps generation, but on 2 cores
  its polling competes with vLLM and the agents for the CPU.

    .venv/bin/python benchmarks/bench_step.py [--steps N] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

GOAL = 0.05
TRAINING_PHASES = ("old_log_prob", "ref", "values", "update_critic", "update_actor", "update_weights")
TIMED_PHASES = ("gen", "adapter", "cut", "adv", *TRAINING_PHASES)


class StepTimers:
    """Seconds per step in the trainer's collection and its sleeps there (verl-style timers cover the rest)."""

    def __init__(self) -> None:
        self.per_step: dict[int, dict[str, float]] = {}
        self.current: defaultdict[str, float] = defaultdict(float)
        self.in_collect = False
        self.created_at: float | None = None

    def install(self) -> Callable[[], None]:
        """Wrap the trainer's methods and ``time.sleep``; returns the function that undoes it."""
        from agl_rollout import AglClient
        from agl_trainer.step.collection import Collection
        from agl_trainer.trainer import AglRayPPOTrainer

        originals: list[tuple[Any, str, Any]] = []

        def wrap(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
            original = getattr(owner, name)
            originals.append((owner, name, original))
            setattr(owner, name, functools.wraps(original)(make(original)))

        wrap(AglRayPPOTrainer, "train_step", self._step)
        wrap(Collection, "take", self._collect)
        wrap(AglClient, "create_rollouts", self._create_rollouts)
        wrap(time, "sleep", self._sleep)

        def undo() -> None:
            for owner, name, original in reversed(originals):
                setattr(owner, name, original)

        return undo

    def _step(self, train_step: Callable[..., Any]) -> Callable[..., Any]:
        def step(trainer: Any, timing: dict[str, float]) -> Any:
            self.current = defaultdict(float)
            metrics = train_step(trainer, timing)
            self.per_step[trainer.global_steps] = dict(self.current)
            return metrics

        return step

    def _collect(self, collect: Callable[..., Any]) -> Callable[..., Any]:
        def flagged(*args: Any, **kwargs: Any) -> Any:
            self.in_collect, self.created_at = True, None
            started = time.time()
            try:
                completed, metrics = collect(*args, **kwargs)
            finally:
                self.in_collect = False
            ended = time.time()
            self.current["collect"] += ended - started
            self.current["enqueue"] += (self.created_at or ended) - started
            finished = [r.finished_at for r in completed if r.finished_at is not None]
            self.current["tail"] += ended - max(finished, default=started)
            return completed, metrics

        return flagged

    def _create_rollouts(self, create: Callable[..., Any]) -> Callable[..., Any]:
        def noted(*args: Any, **kwargs: Any) -> Any:
            created = create(*args, **kwargs)
            if self.in_collect and self.created_at is None:
                self.created_at = time.time()
            return created

        return noted

    def _sleep(self, sleep: Callable[[float], None]) -> Callable[[float], None]:
        def timed_sleep(seconds: float) -> None:
            if not (self.in_collect and threading.current_thread() is threading.main_thread()):
                return sleep(seconds)
            started = time.perf_counter()
            sleep(seconds)
            self.current["collect_sleep"] += time.perf_counter() - started

        return timed_sleep


def _fresh_records(metrics: Path, steps: int, started: float) -> list[dict[str, Any]]:
    """The run's per-step records; exits when the file is not this run's or lacks steps."""
    if not metrics.is_file() or metrics.stat().st_mtime < started:
        raise SystemExit(f"bench_step: {metrics} was not written by this run; no fresh run happened")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    if [record["step"] for record in records] != list(range(1, steps + 1)):
        raise SystemExit(
            f"bench_step: {metrics} has steps {[r['step'] for r in records]}, expected 1..{steps}"
        )
    return records


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(row.get(key, 0.0) for row in rows)


def report(records: list[dict[str, Any]], timers: StepTimers, started: float) -> bool:
    """Print the tables; return whether the learning side stays under the goal."""
    rows = [{**record["data"], **timers.per_step[record["step"]]} for record in records[1:]]
    step_s = _median(rows, "timing_s/step")
    startup_s = records[0]["data"]["timing/step_start_wall"] - started
    print(
        f"start-up (command to first step): {startup_s:.0f} s; median step: {step_s:.2f} s over {len(rows)} steps"
    )
    print(f"{'phase':<40}{'median s':>10}{'share':>8}")

    def line(label: str, seconds: float) -> None:
        print(f"{label:<40}{seconds:>10.4f}{seconds / step_s:>8.2%}")

    for phase in TIMED_PHASES:
        if any(f"timing_s/{phase}" in row for row in rows):
            line(phase, _median(rows, f"timing_s/{phase}"))
    line("step", step_s)
    print(f"server requests per rollout: {_median(rows, 'training/server_requests_per_rollout'):.2f}")

    for row in rows:
        row["manager"] = row.get("collect", 0.0) - row.get("collect_sleep", 0.0)
        row["next_batch"] = row["timing_s/gen"] - row.get("collect", 0.0)
        timed = sum(row.get(f"timing_s/{phase}", 0.0) for phase in TIMED_PHASES)
        row["untimed"] = row["timing_s/step"] - timed
        row["learning"] = (
            row["enqueue"]
            + row["tail"]
            + row["next_batch"]
            + row["timing_s/adapter"]
            + row["timing_s/adv"]
            + row["timing_s/cut"]
            + row["untimed"]
        )
    print("learning side on the critical path:")
    for label, key in (
        ("  enqueue (collection start → created)", "enqueue"),
        ("  tail (last rollout end → collected)", "tail"),
        ("    of it, gateway drain", "training/async/proxy_drain_seconds"),
        ("  next train batch (dataloader)", "next_batch"),
        ("  adapter", "timing_s/adapter"),
        ("  advantage + normalisation", "timing_s/adv"),
        ("  batch cut + to_data_proto", "timing_s/cut"),
        ("  untimed remainder", "untimed"),
    ):
        line(label, _median(rows, key))
    learning = _median(rows, "learning")
    share = learning / step_s
    verdict = "PASS" if share < GOAL else "FAIL"
    print(f"learning side on top of generation and update: {learning:.4f} s = {share:.2%} of the step")
    print(f"{verdict}: goal < {GOAL:.0%}")
    busy = _median(rows, "manager")
    print(
        f"upper bound, the rollout manager's whole busy time in collection (overlaps generation): "
        f"{busy:.4f} s = {busy / step_s:.2%} of the step"
    )
    return share < GOAL


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("extra", nargs="*", help="Hydra overrides for the run")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is left out as warm-up)")
    from agl_trainer.cli import configure_logging
    from agl_trainer.local.demo import run_embedded_default

    configure_logging()
    timers = StepTimers()
    undo = timers.install()
    started = time.time()
    try:
        run = run_embedded_default([f"trainer.total_training_steps={args.steps}", *args.extra])
    finally:
        undo()
    records = _fresh_records(run.metrics, args.steps, started)
    print(f"run: {run.metrics} (wall {time.time() - started:.0f} s)")
    if not report(records, timers, started):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
