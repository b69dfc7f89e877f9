"""Memory over a long run of the embedded default: resident memory of each kind of process, per step.

Runs ``agl-trainer`` (fully async by default) for ``--steps`` steps as a child process and samples
the resident memory (RSS) of every process it started every ``--every`` seconds, summed by kind:
the trainer itself, Ray's workers and daemons, vLLM (its API server and engine core), agl-server.
Each sample is matched to the last step logged in the run's ``metrics.jsonl``. It writes
``soak.csv`` beside the run's metrics and prints, per window of ``--window`` steps, each kind's
median RSS, then each kind's growth over the last ``--tail`` steps in MiB per step (a least-squares
slope) with the first and last window's medians: whether the memory levels off.

    uv run --no-sync python benchmarks/soak_memory.py --steps 1000
    uv run --no-sync python benchmarks/soak_memory.py --steps 300 -- --sync
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

from agl_trainer.local.envs import cache_dir

KINDS: tuple[str, ...] = ("trainer", "ray", "vllm", "agl-server")


def kind_of(process: psutil.Process, trainer_pid: int) -> str | None:
    """Which kind a descendant of the trainer's command is (None: the ``uv`` wrapper and shells)."""
    if process.pid == trainer_pid:
        return "trainer"
    try:
        line = " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    if "vllm" in line or "VLLM" in process.name():
        return "vllm"
    if "ray" in line or process.name().startswith("ray::") or "raylet" in line or "gcs_server" in line:
        return "ray"
    if "agl-server" in line or "agentlightning" in line:
        return "agl-server"
    return None


def trainer_process(root: psutil.Process) -> psutil.Process:
    """The process running the trainer under ``uv run``: the largest descendant whose command runs
    agl-trainer (its name is the script's, not python's), or ``root`` itself."""
    candidates: list[tuple[int, psutil.Process]] = []
    for child in root.children(recursive=True):
        try:
            line = " ".join(child.cmdline())
            if "agl-trainer" in line and "vllm" not in line and not child.name().startswith("ray"):
                candidates.append((child.memory_info().rss, child))
        except psutil.NoSuchProcess:
            continue
    return max(candidates, key=lambda pair: pair[0])[1] if candidates else root


def sample(root: psutil.Process) -> dict[str, float]:
    """MiB of resident memory per kind, over every descendant of ``root`` (and Ray's daemons, which
    leave the tree: they are found by name)."""
    trainer = trainer_process(root)
    totals: dict[str, float] = dict.fromkeys(KINDS, 0.0)
    seen: set[int] = set()
    processes = [root, *root.children(recursive=True)]
    processes += [
        p
        for p in psutil.process_iter(["name"])
        if (p.info["name"] or "").startswith(("ray::", "raylet", "gcs_server"))
    ]
    for process in processes:
        if process.pid in seen:
            continue
        seen.add(process.pid)
        kind = kind_of(process, trainer.pid)
        if kind is None:
            continue
        try:
            totals[kind] += process.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            continue
    return totals


def last_step(metrics: Path) -> int:
    """The last step logged in ``metrics`` (0 before the first)."""
    if not metrics.exists():
        return 0
    step = 0
    for line in metrics.read_text().splitlines():
        try:
            step = int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return step


def newest_run_dir(after: float) -> Path | None:
    runs = [d for d in (cache_dir() / "runs").glob("*") if d.is_dir() and d.stat().st_mtime >= after]
    return max(runs, key=lambda d: d.stat().st_mtime) if runs else None


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares MiB per step over ``(step, MiB)`` points."""
    xs, ys = [float(x) for x, _ in points], [y for _, y in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread if spread else 0.0


def report(rows: list[dict[str, float]], *, window: int, tail: int) -> None:
    """Medians per window and the growth over the last ``tail`` steps. Samples taken at the last
    step are left out: by then the run is shutting its processes down."""
    last = int(max(row["step"] for row in rows))
    rows = [row for row in rows if row["step"] < last]
    print(f"{'steps':>11}  " + "  ".join(f"{kind:>10}" for kind in KINDS) + "   (median MiB)")
    for start in range(1, last + 1, window):
        chosen = [row for row in rows if start <= row["step"] < start + window]
        if chosen:
            medians = [statistics.median(row[kind] for row in chosen) for kind in KINDS]
            print(f"{start:>5}-{start + window - 1:<5}  " + "  ".join(f"{m:>10.0f}" for m in medians))
    tail_rows = [row for row in rows if row["step"] > last - tail]
    print(f"growth over the last {tail} steps (MiB per step, least squares):")
    for kind in KINDS:
        per_step = slope([(int(row["step"]), row[kind]) for row in tail_rows])
        print(f"  {kind:>10}: {per_step:+.3f}")


def report_file(csv_path: Path, *, window: int, tail: int) -> None:
    """:func:`report` of a ``soak.csv`` written earlier."""
    with csv_path.open() as source:
        rows = [{key: float(value) for key, value in row.items()} for row in csv.DictReader(source)]
    report(rows, window=window, tail=tail)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--window", type=int, default=100, help="steps per reported window")
    parser.add_argument("--tail", type=int, default=500, help="steps the growth is fitted over")
    parser.add_argument("--report", type=Path, help="only report this soak.csv of an earlier run")
    parser.add_argument(
        "trainer_args", nargs="*", help="after --: agl-trainer's arguments (default --fully-async)"
    )
    args = parser.parse_args()
    if args.report is not None:
        report_file(args.report, window=args.window, tail=args.tail)
        return
    trainer_args = args.trainer_args or ["--fully-async"]
    command = [
        "uv",
        "run",
        "--no-sync",
        "agl-trainer",
        *trainer_args,
        f"steps={args.steps}",
        "trainer.test_freq=0",
        "trainer.save_freq=0",
    ]
    print("running:", " ".join(command), flush=True)
    started = time.time()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    root = psutil.Process(child.pid)
    rows: list[dict[str, float]] = []
    run_dir: Path | None = None
    while child.poll() is None:
        time.sleep(args.every)
        run_dir = run_dir or newest_run_dir(started)
        if run_dir is None:
            continue
        step = last_step(run_dir / "metrics.jsonl")
        if step == 0:
            continue
        rows.append({"step": float(step), "elapsed_s": time.time() - started, **sample(root)})
        if len(rows) % 60 == 0:
            print(f"step {step}: " + ", ".join(f"{k} {rows[-1][k]:.0f} MiB" for k in KINDS), flush=True)
    if run_dir is None or not rows:
        sys.exit(f"agl-trainer exited with {child.returncode} before logging a step")
    with (run_dir / "soak.csv").open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=["step", "elapsed_s", *KINDS])
        writer.writeheader()
        writer.writerows(rows)
    print(f"agl-trainer exited with {child.returncode}; samples in {run_dir / 'soak.csv'}")
    report(rows, window=args.window, tail=min(args.tail, int(rows[-1]["step"]) - 1))


if __name__ == "__main__":
    main()
