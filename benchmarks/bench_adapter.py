"""Speed and memory of agl_adapter's RolloutAdapter against baselines measured in the same run.

Each case builds one training batch from N rollouts x 8 turns x ~1k tokens per turn (a
~750-token first prompt; then per turn a response and a tool observation of 200-800 tokens
each; token ids up to 150k as separate Python ints, as parsed from JSON) and reports, beside
the adapter:

- ``floor``: allocating the output tensors and writing every element once (memory bandwidth);
- ``convert``: reading every input id and log-prob list once into arrays with the fastest reader
  known (``struct.pack_into``, as the adapter does): what any implementation taking Python lists pays;
- ``lists``: a straightforward list-of-lists implementation (pad with list arithmetic, then
  ``torch.tensor``), skipped above --max-baseline-rollouts because it takes minutes there.

The last line of a case divides the adapter's time by ``convert + floor``: reading the input
once and writing the output once, the least any implementation of this API can do. At trajectory
level the prompts repeat the context, so the input holds ~4.5 ints per output token and reading
them costs several times the fill alone.

Peak memory is the rise of the process's peak RSS during the call (``/proc/self/clear_refs``),
with glibc told to mmap allocations over 128 KiB and the heap trimmed before each call, so
freed buffers leave the RSS at once. Zero-filled outputs that are never written (most of
``token_level_scores``) are not resident, so a peak slightly under 1.00x the output is normal.

``--against REV`` compares the adapter with itself at git revision REV instead: agl-adapter and
agl-types of REV are exported to a temporary folder, and child processes time ``build_batch`` on
the same rollouts with either version, alternating, so both see the same machine state; each
case prints the best time of each and their ratio.

    .venv/bin/python benchmarks/bench_adapter.py            # 64, 256, 1024 rollouts
    .venv/bin/python benchmarks/bench_adapter.py --quick    # 64 rollouts, one repeat
    .venv/bin/python benchmarks/bench_adapter.py --against HEAD~1 --sizes 256
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agl_adapter import RolloutAdapter
from agl_types import CompletedRollout, RolloutState, Triplet

TURNS = 8
VOCAB = 150_000
WIDTHS = {"trajectory": (1024, 8192), "transition": (8192, 1024)}  # (max_prompt_length, max_response_length)
_MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"


def make_rollouts(n: int, seed: int = 0) -> list[CompletedRollout]:
    """n rollouts of TURNS calls; each prompt continues the last (trajectory merges them), ids as fresh ints."""
    rng = np.random.default_rng(seed)
    rollouts: list[CompletedRollout] = []
    for i in range(n):
        context = rng.integers(1, VOCAB, int(rng.integers(500, 1000)))
        triplets: list[Triplet] = []
        for _ in range(TURNS):
            response = rng.integers(1, VOCAB, int(rng.integers(200, 800)))
            log_probs = -rng.random(len(response))
            triplets.append(
                Triplet.model_construct(
                    prompt_token_ids=context.tolist(),
                    response_token_ids=response.tolist(),
                    response_log_probs=log_probs.tolist(),
                    reward=None,
                    metadata={},
                )
            )
            observation = rng.integers(1, VOCAB, int(rng.integers(200, 800)))
            context = np.concatenate((context, response, observation))
        rollouts.append(
            CompletedRollout.model_construct(
                rollout_id=f"r{i}",
                data_id=f"d{i // 8}",
                step=0,
                sample_idx_in_step=i,
                enqueue_time=0.0,
                final_reward=float(rng.random()),
                triplets=triplets,
                rollout_state=RolloutState.SUCCEEDED,
                timed_out=False,
                metadata={},
            )
        )
    return rollouts


def _pad_left(ids: list[int], n: int, pad: int) -> tuple[list[int], list[int]]:
    return [pad] * (n - len(ids)) + ids, [0] * (n - len(ids)) + [1] * len(ids)


def _pad_right(ids: list[Any], n: int, pad: Any) -> tuple[list[Any], list[int]]:
    return ids + [pad] * (n - len(ids)), [1] * len(ids) + [0] * (n - len(ids))


def list_of_lists(
    rollouts: Sequence[CompletedRollout], level: str, p: int, r: int
) -> dict[str, torch.Tensor]:
    """The straightforward implementation: merge and pad with Python lists, convert with torch.tensor."""
    rows: list[tuple[Any, ...]] = []
    for rollout in sorted(rollouts, key=lambda x: (x.step, x.sample_idx_in_step)):
        reward = rollout.final_reward or 0.0
        current: list[Any] | None = None
        context: list[int] = []
        for t in rollout.triplets:
            prompt, response, lps = t.prompt_token_ids, t.response_token_ids, t.response_log_probs
            if level == "trajectory" and current is not None and prompt[: len(context)] == context:
                obs = prompt[len(context) :]
                current[1] += obs + response
                current[2] += [0] * len(obs) + [1] * len(response)
                current[3] = (
                    None if current[3] is None or lps is None else current[3] + [0.0] * len(obs) + lps
                )
            else:
                if current is not None:
                    rows.append((*current, reward))
                current = [
                    list(prompt),
                    list(response),
                    [1] * len(response),
                    None if lps is None else list(lps),
                ]
            context = prompt + response
        if current is not None:
            rows.append((*current, reward))
    prompts, prompt_attn, responses, resp_attn, masks, lps_rows, scores = [], [], [], [], [], [], []
    for prompt, response, mask, lps, reward in rows:
        ids, attn = _pad_left(prompt[:p], p, 0)
        prompts.append(ids)
        prompt_attn.append(attn)
        response, mask = response[:r], mask[:r]
        ids, attn = _pad_right(response, r, 0)
        responses.append(ids)
        resp_attn.append(attn)
        masks.append(_pad_right(mask, r, 0)[0])
        lps_rows.append(_pad_right((lps or [])[:r], r, 0.0)[0])
        scores.append([0.0] * (len(response) - 1) + [reward] + [0.0] * (r - len(response)))
    out = {
        "prompts": torch.tensor(prompts),
        "responses": torch.tensor(responses),
        "response_mask": torch.tensor(masks),
        "token_level_scores": torch.tensor(scores, dtype=torch.float32),
        "rollout_log_probs": torch.tensor(lps_rows, dtype=torch.float32),
    }
    out["input_ids"] = torch.cat([out["prompts"], out["responses"]], dim=1)
    out["attention_mask"] = torch.cat([torch.tensor(prompt_attn), torch.tensor(resp_attn)], dim=1)
    out["position_ids"] = torch.clamp(torch.cumsum(out["attention_mask"], dim=1) - 1, min=0)
    out["is_drop_mask"] = torch.tensor([len(row[0]) > p for row in rows])
    return out


def fill_floor(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """Allocate every output tensor and write each element once."""
    return {key: torch.empty(shape, dtype=dtype).fill_(1) for key, (shape, dtype) in shapes.items()}


def _read(values: Sequence[Any], code: str, dtype: type[np.generic]) -> int:
    out = np.empty(len(values), dtype=dtype)
    struct.pack_into(f"{len(values)}{code}", out, 0, *values)
    return len(out)


def convert_floor(rollouts: Sequence[CompletedRollout]) -> int:
    """Read every input id and log-prob list once into arrays (what any implementation taking Python lists pays)."""
    n = 0
    for rollout in rollouts:
        for t in rollout.triplets:
            n += _read(t.prompt_token_ids, "q", np.int64) + _read(t.response_token_ids, "q", np.int64)
            if t.response_log_probs is not None:
                n += _read(t.response_log_probs, "f", np.float32)
    return n


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} missing from /proc/self/status")


_LIBC = ctypes.CDLL("libc.so.6")


def measure(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(best seconds, peak RSS rise in bytes of the first call).

    The heap is trimmed first: glibc otherwise returns an earlier case's freed memory in the
    middle of the call, which hides that much of the call's own growth.
    """
    best, peak = float("inf"), 0.0
    for i in range(repeats):
        gc.collect()
        _LIBC.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        before = _status_kib("VmRSS")
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
        if i == 0:
            peak = (_status_kib("VmHWM") - before) * 1024.0
        del result
    return best, peak


def run_case(n: int, level: str, repeats: int, max_baseline: int) -> None:
    p, r = WIDTHS[level]
    rollouts = make_rollouts(n)
    adapter = RolloutAdapter(
        max_prompt_length=p, max_response_length=r, pad_token_id=0, trace_aggregator_level=level
    )
    batch, metrics = adapter.build_batch(rollouts)
    tensors = batch.tensors()
    out_bytes = float(sum(t.numel() * t.element_size() for t in tensors.values()))
    n_rows, n_tokens = len(batch), int(batch.attention_mask.sum())
    shapes = {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}
    del batch, tensors
    results = {
        "adapter": measure(lambda: adapter.build_batch(rollouts), repeats),
        "floor": measure(lambda: fill_floor(shapes), repeats),
        "convert": measure(lambda: convert_floor(rollouts), repeats),
    }
    if n <= max_baseline:
        results["lists"] = measure(lambda: list_of_lists(rollouts, level, p, r), 1)
    print(
        f"\n{level} N={n} rollouts: {n_rows} rows x (P={p} + R={r}), {n_tokens / 1e6:.1f}M valid tokens, "
        f"output {out_bytes / 2**20:.0f} MiB, truncated {metrics['training/n_truncated_sample']}"
    )
    print(
        f"  {'impl':8} {'seconds':>8} {'rows/s':>9} {'Mtok/s':>7} {'x floor':>7} {'peak MiB':>9} {'x out':>6}"
    )
    floor_s = results["floor"][0]
    for name, (seconds, peak) in results.items():
        print(
            f"  {name:8} {seconds:8.3f} {n_rows / seconds:9.0f} {n_tokens / seconds / 1e6:7.1f} "
            f"{seconds / floor_s:7.1f} {peak / 2**20:9.0f} {peak / out_bytes:6.2f}"
        )
    bound_s = floor_s + results["convert"][0]
    print(f"  adapter / (convert + floor) = {results['adapter'][0] / bound_s:.2f}x")


def adapter_seconds(n: int, level: str, repeats: int) -> float:
    """Best time of ``build_batch`` on the benchmark's rollouts, in this process's agl_adapter."""
    p, r = WIDTHS[level]
    rollouts = make_rollouts(n)
    adapter = RolloutAdapter(
        max_prompt_length=p, max_response_length=r, pad_token_id=0, trace_aggregator_level=level
    )
    adapter.build_batch(rollouts)  # warm-up: imports, first allocations
    return measure(lambda: adapter.build_batch(rollouts), repeats)[0]


_PACKAGES = ("agl-adapter", "agl-types")


def _export(revision: str, into: Path) -> str:
    """Write agl-adapter's and agl-types' sources at ``revision`` under ``into``; the PYTHONPATH for them."""
    root = Path(__file__).resolve().parent.parent
    paths = [f"packages/{package}/src" for package in _PACKAGES]
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", revision, *paths], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return os.pathsep.join(str(into / path) for path in paths)


def _child_seconds(pythonpath: str | None, n: int, level: str, repeats: int) -> float:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    argv = [sys.executable, __file__, "--time-only", "--sizes", str(n), "--levels", level]
    argv += ["--repeats", str(repeats)]
    out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env).stdout
    return float(json.loads(out.splitlines()[-1])["seconds"])


def compare_with_revision(revision: str, sizes: Sequence[int], levels: Sequence[str], rounds: int) -> None:
    """Time this checkout's adapter and ``revision``'s in alternating child processes, per case."""
    with tempfile.TemporaryDirectory(prefix="agl-bench-") as folder:
        baseline_path = _export(revision, Path(folder))
        print(f"this checkout against {revision}, best of {rounds} alternating rounds x 3 repeats")
        for level in levels:
            for n in sizes:
                ours, theirs = float("inf"), float("inf")
                for _ in range(rounds):
                    theirs = min(theirs, _child_seconds(baseline_path, n, level, 3))
                    ours = min(ours, _child_seconds(None, n, level, 3))
                print(
                    f"  {level:10} N={n:5}: {revision} {theirs:.3f} s, this checkout {ours:.3f} s, "
                    f"ratio {ours / theirs:.2f}x"
                )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Speed and memory of agl_adapter's RolloutAdapter.")
    parser.add_argument("--quick", action="store_true", help="64 rollouts, one repeat")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--levels", nargs="+", default=["trajectory", "transition"], choices=sorted(WIDTHS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-baseline-rollouts", type=int, default=256)
    parser.add_argument("--against", metavar="REV", help="compare with the adapter at this git revision")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per case with --against")
    parser.add_argument("--time-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes, repeats = ([64], 1) if args.quick else (args.sizes, args.repeats)
    torch.set_num_threads(1)
    if args.time_only:
        print(json.dumps({"seconds": adapter_seconds(sizes[0], args.levels[0], repeats)}))
        return
    if args.against:
        compare_with_revision(args.against, sizes, args.levels, args.rounds)
        return
    print(
        f"torch {torch.__version__}, numpy {np.__version__}, {os.cpu_count()} cpus, {TURNS} turns per rollout"
    )
    for level in args.levels:
        for n in sizes:
            run_case(n, level, repeats, args.max_baseline_rollouts)


if __name__ == "__main__":
    if _MMAP_ENV not in os.environ:  # glibc reads it at start, so re-exec once with it set
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, _MMAP_ENV: str(128 * 1024)})
    main()
