"""Benchmark of agl-algos' per-step cost: rollout normalisation and the per-rollout-mean loss.

For rows x tokens from 64 x 1k to 1024 x 8k (4 rows per rollout, random response lengths) it times
``normalize_advantages_by_rollout`` and the loss forward + backward, against, in the same run, verl's
vanilla token-mean loss on the same tensors and a straightforward per-row Python normalisation.
Goals: normalisation < 5% of the loss; loss <= 1.1x verl's vanilla loss.

    .venv/bin/python benchmarks/bench_algos.py [--quick] [--device cpu|cuda] [--repeats N]
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from agl_algos import PolicyLossConfig, compute_policy_loss_per_rollout_mean, normalize_advantages_by_rollout

ROWS_PER_ROLLOUT = 4
FULL_SIZES = ((64, 1024), (256, 2048), (512, 4096), (1024, 8192))
QUICK_SIZES = ((64, 1024), (128, 2048))


def per_row_normalize(
    advantages: torch.Tensor, mask: torch.Tensor, rollout_ids: Any, n_rows: int
) -> torch.Tensor:
    """The obvious implementation: a Python dict of token counts and one divisor per row."""
    row_tokens = mask.sum(-1).to(advantages.dtype)
    totals: dict[Any, float] = {}
    for row, rid in enumerate(rollout_ids):
        totals[rid] = totals.get(rid, 0.0) + float(row_tokens[row].item())
    divisors = torch.tensor([totals[rid] * n_rows for rid in rollout_ids], dtype=advantages.dtype)
    return advantages / divisors.to(advantages.device).clamp_min(1.0).unsqueeze(-1)


def make_inputs(n_rows: int, n_tokens: int, device: torch.device) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(n_rows * n_tokens)
    lengths = torch.randint(1, n_tokens + 1, (n_rows,), generator=gen)
    mask = (torch.arange(n_tokens).unsqueeze(0) < lengths.unsqueeze(-1)).to(torch.int64)
    old = -torch.rand(n_rows, n_tokens, generator=gen) * 3
    rollout_ids = np.array([f"rollout-{row // ROWS_PER_ROLLOUT}" for row in range(n_rows)], dtype=object)
    advantages = torch.randn(n_rows // ROWS_PER_ROLLOUT, 1, generator=gen).repeat_interleave(
        ROWS_PER_ROLLOUT, 0
    )
    return {
        "old": old.to(device),
        "new": (old + torch.randn(n_rows, n_tokens, generator=gen) * 0.1).to(device),
        "advantages": (advantages.expand(n_rows, n_tokens) * mask).contiguous().to(device),
        "mask": mask.to(device),
        "rollout_ids": rollout_ids,
    }


def timed(fns: dict[str, Callable[[], object]], device: torch.device, repeats: int) -> dict[str, float]:
    """Best (minimum) seconds of each function over ``repeats`` rounds after one warm-up round.

    The functions run interleaved, round after round, so load from other processes on a shared machine
    hits all of them alike; the minimum is the least noisy estimate of the intrinsic cost.
    """

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    best = dict.fromkeys(fns, float("inf"))
    for round_index in range(repeats + 1):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if round_index:
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def loss_step(
    loss_fn: Callable[..., tuple[torch.Tensor, dict[str, Any]]], inputs: dict[str, Any], config: Any
) -> Callable[[], None]:
    def step() -> None:
        log_prob = inputs["new"].detach().requires_grad_(True)
        loss, _ = loss_fn(
            inputs["old"], log_prob, inputs["advantages"], inputs["mask"], "token-mean", config, None
        )
        loss.backward()

    return step


def vanilla_loss() -> tuple[Callable[..., Any] | None, Any]:
    try:
        from verl.trainer.ppo.core_algos import get_policy_loss_fn
        from verl.workers.config import FSDPActorConfig
    except ImportError:
        return None, None
    config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    return get_policy_loss_fn("vanilla"), config


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_size(
    n_rows: int, n_tokens: int, device: torch.device, repeats: int, vanilla: Any, vanilla_config: Any
) -> str:
    """Time one size; returns its table line."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    inputs = make_inputs(n_rows, n_tokens, device)
    ids, adv, mask = inputs["rollout_ids"], inputs["advantages"], inputs["mask"]
    normalized = normalize_advantages_by_rollout(adv, mask, ids, num_trained_rows=n_rows)
    fns: dict[str, Callable[[], object]] = {
        "norm": lambda: normalize_advantages_by_rollout(adv, mask, ids, num_trained_rows=n_rows),
        "loop": lambda: per_row_normalize(adv, mask, ids, n_rows),
        "ours": loss_step(
            compute_policy_loss_per_rollout_mean, {**inputs, "advantages": normalized}, PolicyLossConfig()
        ),
    }
    if vanilla is not None:
        fns["verl"] = loss_step(vanilla, {**inputs, "advantages": normalized}, vanilla_config)
    best = timed(fns, device, repeats)
    norm, loop, ours, theirs = best["norm"], best["loop"], best["ours"], best.get("verl", float("nan"))
    return (
        f"{f'{n_rows} x {n_tokens}':>14} {norm * 1e3:9.2f} {loop * 1e3:9.2f} {ours * 1e3:9.2f} {theirs * 1e3:9.2f} "
        f"{norm / ours:10.3f} {ours / theirs:10.3f} {loop / norm:10.1f} {peak_memory_mib(device):9.0f} "
        f"{'cuda alloc' if device.type == 'cuda' else 'proc RSS':>10}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes only (seconds)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    device = torch.device(args.device)
    vanilla, vanilla_config = vanilla_loss()
    print(
        f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} rows/rollout={ROWS_PER_ROLLOUT}"
    )
    if vanilla is None:
        print("verl not installed: the vanilla-loss column is skipped")
    print(
        f"{'rows x tokens':>14} {'norm ms':>9} {'loop ms':>9} {'loss ms':>9} {'verl ms':>9} {'norm/loss':>10} "
        f"{'loss/verl':>10} {'loop/norm':>10} {'peak MiB':>9} {'peak kind':>10}"
    )
    for n_rows, n_tokens in QUICK_SIZES if args.quick else FULL_SIZES:
        print(run_size(n_rows, n_tokens, device, args.repeats, vanilla, vanilla_config), flush=True)


if __name__ == "__main__":
    main()
