"""Sync vs carry-over async vs fully-async on the embedded default with heavy-tailed tool latency.

Runs ``agl-trainer`` in this process's environment for each mode, same task, steps and seed, each
with ``tool_latency=0.5:6`` (lognormal tool calls, median 0.5 s, p99 6 s) and ``trainer.test_freq=2``
(validation on 32 rollouts after every second step and the last), and prints for each mode:

- the trained samples per second: ``training/n_sample_trained`` of steps 2..N over the wall time
  from the end of step 1 to the end of step N, less the validation time (``timing_s/testing``)
  inside that window;
- the time to the target reward (``--target-reward``, default 0.8): the wall time from the start
  of step 1 to the end of the first step whose ``val/reward`` reaches the target, less all the
  validation time up to and including that step ("not reached" when no validation within
  ``--steps`` does);
- the training reward (mean ``training/reward`` of the last three steps: fully async samples those
  with weights up to K versions old) and the validation reward of the final weights (``val/reward``
  after step N);
- where a step's time went (means over steps 2..N): waiting for rollouts (``timing_s/gen``) and
  training (``timing_s/old_log_prob`` plus ``timing_s/update_actor``); on a machine where vLLM and
  the actor share the cores, the second grows when collection overlaps it.

    uv run --no-sync python benchmarks/bench_async.py [--steps 20] [--tool-latency 0.5:6] [--repeats 3] [--target-reward 0.8]

One mode's runs end at quite different rewards (the validation reward of sync's final weights after
twelve steps ranged 0.27-0.81 on this machine), so ``--repeats R`` (default 3) runs the three modes
R times, interleaved, and prints every run's figures and the median of each column, with ratios
against sync's medians.

Goal: fully-async reaches the target reward in <= 0.5x sync's time and trains >= 2.5x sync's
samples/s (judged on the medians).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODES = {"sync": "--sync", "async": "--async", "fully-async": "--fully-async"}
TEST_FREQ = 2
THROUGHPUT_GOAL = 2.5
TIME_TO_REWARD_GOAL = 0.5


@dataclass(frozen=True)
class Result:
    """One run's figures, or the medians of several runs'."""

    mode: str
    samples_per_s: float
    time_to_reward_s: float | None
    """``None``: no validation reached the target reward."""
    final_reward: float
    val_reward: float
    mean_staleness: float | None
    wait_s_per_step: float
    train_s_per_step: float


def run_mode(mode: str, overrides: list[str]) -> Path:
    """Run the embedded default in ``mode`` with ``overrides``; return its metrics.jsonl."""
    command = ["agl-trainer", MODES[mode], *overrides]
    print(f"==> {' '.join(command)}", file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    match = re.search(r"Metrics: (\S+metrics\.jsonl)", done.stdout)
    if done.returncode != 0 or match is None:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"the {mode} run failed (exit {done.returncode})")
    return Path(match.group(1))


def time_to_reward(data: list[dict[str, Any]], target: float) -> float | None:
    """Wall time from the start of the first step to the end of the first step validated at
    ``target`` or above, less the validation time up to and including that step (so: to the end of
    that step's training, less the validation before it)."""
    start = data[0]["timing/step_start_wall"]
    testing = 0.0
    for d in data:
        if d.get("val/reward", -1.0) >= target:
            return d["timing/step_start_wall"] + d["timing_s/step"] - start - testing
        testing += d.get("timing_s/testing", 0.0)
    return None


def summarise(mode: str, metrics_file: Path, target: float) -> Result:
    steps = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    rows = sorted(
        (s for s in steps if "training/n_sample_trained" in s.get("data", s)), key=lambda s: s["step"]
    )
    data = [s.get("data", s) for s in rows]
    if "val/reward" not in data[-1]:
        raise SystemExit(f"bench_async: the {mode} run did not validate its final weights ({metrics_file})")
    ends = [d["timing/step_start_wall"] + d["timing_s/step"] for d in data]
    # Validation after steps 1..N-1 falls between the end of step 1 and the end of step N.
    wall = ends[-1] - ends[0] - sum(d.get("timing_s/testing", 0.0) for d in data[:-1])
    trained = sum(d["training/n_sample_trained"] for d in data[1:])
    rewards = [d["training/reward"] for d in data[-3:]]
    timed = data[1:]
    wait = [d.get("timing_s/gen", 0.0) for d in timed]
    train = [d.get("timing_s/old_log_prob", 0.0) + d.get("timing_s/update_actor", 0.0) for d in timed]
    stale = [d["training/async/staleness_mean"] for d in data if "training/async/staleness_mean" in d]
    return Result(
        mode=mode,
        samples_per_s=trained / wall,
        time_to_reward_s=time_to_reward(data, target),
        final_reward=sum(rewards) / len(rewards),
        val_reward=float(data[-1]["val/reward"]),
        mean_staleness=sum(stale) / len(stale) if stale else None,
        wait_s_per_step=sum(wait) / len(wait),
        train_s_per_step=sum(train) / len(train),
    )


def median_result(runs: list[Result]) -> Result:
    """The median of one mode's runs, field by field; a run that never reached the target reward
    counts as slower than every run that did."""
    reached = [float("inf") if r.time_to_reward_s is None else r.time_to_reward_s for r in runs]
    to_reward = statistics.median(reached)
    stale = [r.mean_staleness for r in runs if r.mean_staleness is not None]
    return Result(
        mode=runs[0].mode,
        samples_per_s=statistics.median(r.samples_per_s for r in runs),
        time_to_reward_s=None if to_reward == float("inf") else to_reward,
        final_reward=statistics.median(r.final_reward for r in runs),
        val_reward=statistics.median(r.val_reward for r in runs),
        mean_staleness=statistics.median(stale) if stale else None,
        wait_s_per_step=statistics.median(r.wait_s_per_step for r in runs),
        train_s_per_step=statistics.median(r.train_s_per_step for r in runs),
    )


def time_ratio(r: Result, base: Result) -> float | None:
    """``r``'s time to the target reward over ``base``'s; ``None`` when either never reached it."""
    if r.time_to_reward_s is None or base.time_to_reward_s is None:
        return None
    return r.time_to_reward_s / base.time_to_reward_s


def seconds(time_to_reward_s: float | None) -> str:
    return "not reached" if time_to_reward_s is None else f"{time_to_reward_s:.1f}"


def row(label: str, r: Result, base: Result) -> str:
    """One table row; the ratios and differences are against ``base`` (sync's medians)."""
    ratio = time_ratio(r, base)
    staleness = "-" if r.mean_staleness is None else f"{r.mean_staleness:.2f}"
    return (
        f"{label:<20} {r.samples_per_s:>10.2f} {r.samples_per_s / base.samples_per_s:>7.2f} "
        f"{seconds(r.time_to_reward_s):>12} {'-' if ratio is None else f'{ratio:.2f}':>7} "
        f"{r.final_reward:>13.3f} {r.final_reward - base.final_reward:>+7.3f} "
        f"{r.val_reward:>11.3f} {r.val_reward - base.val_reward:>+7.3f} {staleness:>10} "
        f"{r.wait_s_per_step:>12.2f} {r.train_s_per_step:>13.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tool-latency", default="0.5:6")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per mode (interleaved); medians are printed"
    )
    parser.add_argument("--target-reward", type=float, default=0.8)
    parser.add_argument("extra", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    runs: dict[str, list[Result]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            overrides = [
                f"steps={args.steps}",
                f"tool_latency={args.tool_latency}",
                f"trainer.test_freq={TEST_FREQ}",
            ]
            metrics = run_mode(mode, [*overrides, *args.extra])
            runs[mode].append(summarise(mode, metrics, args.target_reward))
    medians = {mode: median_result(runs[mode]) for mode in MODES}
    base = medians["sync"]
    print(
        f"\nevery run and the median of {args.repeats} per mode; ratios and differences against sync's median"
    )
    to_reward = f"s to {args.target_reward:g}"
    print(
        f"{'mode':<20} {'samples/s':>10} {'x sync':>7} {to_reward:>12} {'x sync':>7} "
        f"{'train reward':>13} {'- sync':>7} {'val reward':>11} {'- sync':>7} {'staleness':>10} "
        f"{'wait s/step':>12} {'train s/step':>13}"
    )
    for mode in MODES:
        for i, r in enumerate(runs[mode], 1):
            print(row(f"{mode} run {i}", r, base))
        print(row(f"{mode} median", medians[mode], base))
    fully = medians["fully-async"]
    speedup = fully.samples_per_s / base.samples_per_s
    ratio = time_ratio(fully, base)
    if ratio is not None:
        time_verdict = f"{ratio:.2f}x sync: {'met' if ratio <= TIME_TO_REWARD_GOAL else 'not met'}"
    elif fully.time_to_reward_s is None:
        time_verdict = "not met"
    else:
        time_verdict = "undecided: sync did not reach it (run more --steps)"
    print(
        f"\nfully-async seconds to reward {args.target_reward:g}: {seconds(fully.time_to_reward_s)} vs "
        f"sync {seconds(base.time_to_reward_s)} (goal <= {TIME_TO_REWARD_GOAL}x sync): {time_verdict}"
    )
    print(
        f"fully-async samples/s: {speedup:.2f}x sync (goal >= {THROUGHPUT_GOAL}x): "
        f"{'met' if speedup >= THROUGHPUT_GOAL else 'not met'}"
    )


if __name__ == "__main__":
    main()
