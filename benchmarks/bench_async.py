"""Sync vs carry-over async vs fully-async on the embedded default with heavy-tailed tool latency.

Runs ``agl-trainer`` three times in this process's environment, same task, steps and seed, each
with ``tool_latency=0.5:6`` (lognormal tool calls, median 0.5 s, p99 6 s), and prints for each mode
the trained samples per second (``training/n_sample_trained`` of steps 2..N over the wall time
from the end of step 1 to the end of step N), the training reward (mean ``training/reward`` of the
last three steps: fully async samples those with weights up to K versions old) and the validation
reward of the final weights (``val/reward`` after step N, outside the timed window), with ratios
against sync measured in the same run. Two more columns say where a step's time went (means over
steps 2..N): waiting for rollouts (``timing_s/gen``) and training (``timing_s/old_log_prob`` plus
``timing_s/update_actor``); on a machine where vLLM and the actor share the cores, the second grows
when collection overlaps it.

    uv run --no-sync python benchmarks/bench_async.py [--steps 20] [--tool-latency 0.5:6] [--repeats 3]

Twelve-step runs of one mode end at quite different rewards (the validation reward of sync's
final weights ranged 0.27-0.81 on this machine), so ``--repeats R`` runs the three modes R times,
interleaved, and prints the mean of each column with every run's validation reward beside it.

Goal (issue 14): fully-async >= 2.5x sync samples/s, final reward >= sync's - 0.05 (judged on the
validation reward of the final weights).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

MODES = {"sync": "--sync", "async": "--async", "fully-async": "--fully-async"}
THROUGHPUT_GOAL = 2.5
REWARD_MARGIN = 0.05


@dataclass(frozen=True)
class Result:
    """One run's figures, or the mean of several runs' (``val_rewards`` then lists each run's)."""

    mode: str
    samples_per_s: float
    final_reward: float
    val_rewards: tuple[float, ...]
    wall_s: float
    mean_staleness: float | None
    wait_s_per_step: float
    train_s_per_step: float

    @property
    def val_reward(self) -> float:
        """The validation reward of the final weights (the mean over the runs)."""
        return sum(self.val_rewards) / len(self.val_rewards)


def run_mode(mode: str, steps: int, tool_latency: str, extra: list[str]) -> Path:
    """Run the embedded default in ``mode``; return its metrics.jsonl."""
    command = ["agl-trainer", MODES[mode], f"steps={steps}", f"tool_latency={tool_latency}"]
    command += [f"trainer.test_freq={steps}", *extra]  # validate the final weights once
    print(f"==> {' '.join(command)}", file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    match = re.search(r"Metrics: (\S+metrics\.jsonl)", done.stdout)
    if done.returncode != 0 or match is None:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"bench_async: the {mode} run failed (exit {done.returncode})")
    return Path(match.group(1))


def summarise(mode: str, metrics_file: Path) -> Result:
    steps = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    rows = sorted(
        (s for s in steps if "training/n_sample_trained" in s.get("data", s)), key=lambda s: s["step"]
    )
    data = [s.get("data", s) for s in rows]
    ends = [d["timing/step_start_wall"] + d["timing_s/step"] for d in data]
    wall = ends[-1] - ends[0]
    trained = sum(d["training/n_sample_trained"] for d in data[1:])
    rewards = [d["training/reward"] for d in data[-3:]]
    timed = data[1:]
    wait = [d.get("timing_s/gen", 0.0) for d in timed]
    train = [d.get("timing_s/old_log_prob", 0.0) + d.get("timing_s/update_actor", 0.0) for d in timed]
    stale = [d["training/async/staleness_mean"] for d in data if "training/async/staleness_mean" in d]
    if "val/reward" not in data[-1]:
        raise SystemExit(f"bench_async: the {mode} run did not validate its final weights ({metrics_file})")
    return Result(
        mode=mode,
        samples_per_s=trained / wall,
        final_reward=sum(rewards) / len(rewards),
        val_rewards=(float(data[-1]["val/reward"]),),
        wall_s=wall,
        mean_staleness=sum(stale) / len(stale) if stale else None,
        wait_s_per_step=sum(wait) / len(wait),
        train_s_per_step=sum(train) / len(train),
    )


def mean_result(runs: list[Result]) -> Result:
    """The mean of one mode's runs, field by field."""

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    stale = [r.mean_staleness for r in runs if r.mean_staleness is not None]
    return Result(
        mode=runs[0].mode,
        samples_per_s=mean([r.samples_per_s for r in runs]),
        final_reward=mean([r.final_reward for r in runs]),
        val_rewards=tuple(v for r in runs for v in r.val_rewards),
        wall_s=mean([r.wall_s for r in runs]),
        mean_staleness=mean(stale) if stale else None,
        wait_s_per_step=mean([r.wait_s_per_step for r in runs]),
        train_s_per_step=mean([r.train_s_per_step for r in runs]),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tool-latency", default="0.5:6")
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs per mode (interleaved); means are printed"
    )
    parser.add_argument("extra", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    runs: dict[str, list[Result]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            runs[mode].append(summarise(mode, run_mode(mode, args.steps, args.tool_latency, args.extra)))
    results = [mean_result(runs[mode]) for mode in MODES]
    base = results[0]
    if args.repeats > 1:
        print(f"\nmeans over {args.repeats} runs per mode")
    print(
        f"\n{'mode':<12} {'samples/s':>10} {'x sync':>7} {'train reward':>13} {'- sync':>7} "
        f"{'val reward':>11} {'- sync':>7} {'staleness':>10} {'wait s/step':>12} {'train s/step':>13}"
    )
    for r in results:
        staleness = "-" if r.mean_staleness is None else f"{r.mean_staleness:.2f}"
        print(
            f"{r.mode:<12} {r.samples_per_s:>10.2f} {r.samples_per_s / base.samples_per_s:>7.2f} "
            f"{r.final_reward:>13.3f} {r.final_reward - base.final_reward:>+7.3f} "
            f"{r.val_reward:>11.3f} {r.val_reward - base.val_reward:>+7.3f} {staleness:>10} "
            f"{r.wait_s_per_step:>12.2f} {r.train_s_per_step:>13.2f}"
        )
    if args.repeats > 1:
        for r in results:
            print(f"{r.mode:<12} validation reward per run: {', '.join(f'{v:.3f}' for v in r.val_rewards)}")
    fully = results[-1]
    speedup = fully.samples_per_s / base.samples_per_s
    reward_ok = fully.val_reward >= base.val_reward - REWARD_MARGIN
    verdict = "PASS" if speedup >= THROUGHPUT_GOAL and reward_ok else "FAIL"
    print(
        f"\nfully-async: {speedup:.2f}x sync samples/s (goal >= {THROUGHPUT_GOAL}), validation reward of the "
        f"final weights {fully.val_reward - base.val_reward:+.3f} vs sync (goal >= -{REWARD_MARGIN}): {verdict}"
    )


if __name__ == "__main__":
    main()
