"""Reward curves of the embedded default in the three modes, for a variant (LoRA by default)
against a baseline (the embedded default's full-weight training by default) measured in the same run.

Each mode runs ``--repeats`` times with the baseline's overrides and with the variant's,
interleaved, with no tool latency and one validation on 32 rollouts after the last step. For each
mode and variant it prints the training reward (``training/reward``) every ``--every`` steps as the
median and range over the runs, the first step whose training reward reached ``--target-reward``
(median and range; "never" for a run that did not) and the validation reward of the final weights,
with the variant's step to the target as a ratio of the baseline's.

    uv run --no-sync python benchmarks/bench_reward_curves.py [--steps 25] [--repeats 3] \\
        [--variant 'actor_rollout_ref.model.lora_rank=8 actor_rollout_ref.model.lora_alpha=16 actor_rollout_ref.actor.optim.lr=1e-2']

Goal (issue: LoRA): a clear reward rise with LoRA in each mode.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
from dataclasses import dataclass
from pathlib import Path

from bench_async import MODES, run_mode

LORA = (
    "actor_rollout_ref.model.lora_rank=8 actor_rollout_ref.model.lora_alpha=16 "
    "actor_rollout_ref.actor.optim.lr=1e-2"
)


@dataclass(frozen=True)
class Curve:
    """One run: the training reward of each step and the validation reward of its final weights."""

    rewards: list[float]
    val_reward: float

    def first_step_at(self, target: float) -> int | None:
        return next((step for step, r in enumerate(self.rewards, 1) if r >= target), None)


def read_curve(metrics_file: Path) -> Curve:
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    data = [r["data"] for r in sorted(rows, key=lambda r: r["step"]) if "training/reward" in r["data"]]
    if "val/reward" not in data[-1]:
        raise SystemExit(f"bench_reward_curves: the run did not validate its final weights ({metrics_file})")
    return Curve(
        rewards=[float(d["training/reward"]) for d in data], val_reward=float(data[-1]["val/reward"])
    )


def spread(values: list[float], digits: int = 2) -> str:
    """``median [min-max]``."""
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def steps_to(curves: list[Curve], target: float) -> tuple[str, float | None]:
    """The median and range of the first step at ``target``, a run that never got there counting as
    slower than any that did; and the median as a number (``None`` when it is such a run)."""
    reached = [c.first_step_at(target) for c in curves]
    ordered = sorted(float("inf") if s is None else float(s) for s in reached)
    median = statistics.median(ordered)
    shown = ["never" if s == float("inf") else f"{s:.0f}" for s in (median, ordered[0], ordered[-1])]
    return f"{shown[0]} [{shown[1]} to {shown[2]}]", None if median == float("inf") else median


def report(label: str, curves: list[Curve], every: int, target: float) -> float | None:
    steps = len(curves[0].rewards)
    shown = [s for s in range(1, steps + 1) if s % every == 0 or s == 1 or s == steps]
    print(f"\n{label} ({len(curves)} runs): training reward, median [min-max]")
    for step in shown:
        print(f"  step {step:>3}  {spread([c.rewards[step - 1] for c in curves])}")
    text, median = steps_to(curves, target)
    print(f"  first step at {target:g}: {text}")
    print(f"  validation reward of the final weights: {spread([c.val_reward for c in curves])}")
    return median


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode and variant (interleaved)")
    parser.add_argument("--every", type=int, default=5, help="print the reward of every N-th step")
    parser.add_argument("--target-reward", type=float, default=0.8)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--variant", default=LORA, help="Hydra overrides of the variant, one string")
    parser.add_argument(
        "--baseline", default="", help="Hydra overrides of the baseline, one string (default: none)"
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    variants = {"baseline": shlex.split(args.baseline), "variant": shlex.split(args.variant)}
    every_run = [f"steps={args.steps}", f"trainer.test_freq={args.steps}"]
    curves: dict[tuple[str, str], list[Curve]] = {}
    for _ in range(args.repeats):
        for mode in args.modes:
            for name, overrides in variants.items():
                metrics = run_mode(mode, [*every_run, *overrides])
                curves.setdefault((mode, name), []).append(read_curve(metrics))
    print(f"\nbaseline: {args.baseline or 'the embedded default (full weights)'}\nvariant: {args.variant}")
    for mode in args.modes:
        base, variant = (
            report(f"{mode}, {name}", curves[mode, name], args.every, args.target_reward) for name in variants
        )
        ratio = "-" if base is None or variant is None else f"{variant / base:.2f}x"
        print(
            f"  {mode}: the variant's median first step at {args.target_reward:g} is {ratio} the baseline's"
        )


if __name__ == "__main__":
    main()
