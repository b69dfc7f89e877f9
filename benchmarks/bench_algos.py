"""Benchmark of agl-algos' per-step cost: rollout normalisation and the per-rollout losses.

For rows x tokens from 64 x 1k to 1024 x 8k (4 rows per rollout, random response lengths) it times
``normalize_advantages_by_rollout`` (from the ids, and from precomputed ``rollout_codes``) and the
per_rollout_mean loss forward + backward, against, in the same run, verl's vanilla token-mean loss on the
same tensors and a straightforward per-row Python normalisation. Goals: normalisation < 5% of the loss;
loss <= 1.1x verl's vanilla loss.

A second table times cispo_per_rollout_mean and gspo_per_rollout (forward + backward) against verl's
``cispo`` and ``gspo`` (token-sum; verl's GSPO takes its ratio per row) and against a plain per-row
Python loop computing the same loss (for GSPO, one ratio per rollout gathered from its rows). Goal:
each <= 1.1x its verl counterpart. A third table does the same for geo_mean_per_rollout against
verl's ``geo_mean`` (whose geometric mean is taken per row) and a per-rollout loop.

Timing is autorange-style: each sample repeats a function until it has run >= 5 ms, and the best of
20 samples (interleaved across functions, so a loaded machine slows all alike) is reported per call.
Peak memory is per function and per call, above what existed before it: on CUDA
``max_memory_allocated``; on CPU, where torch has no allocation counter, the resident set's
high-water mark (VmHWM, reset through /proc/self/clear_refs) over one call, less the resident set
before it, with every allocation >= 128 KiB its own mmap (Linux and glibc only; smaller allocations
reused from malloc's free lists are not counted).

    .venv/bin/python benchmarks/bench_algos.py [--quick] [--device cpu|cuda] [--samples N]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from agl_algos import (
    PolicyLossConfig,
    compute_policy_loss_cispo_per_rollout_mean,
    compute_policy_loss_geo_mean_per_rollout,
    compute_policy_loss_gspo_per_rollout,
    compute_policy_loss_per_rollout_mean,
    normalize_advantages_by_rollout,
)

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


def per_row_cispo(
    old: torch.Tensor,
    new: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig,
) -> torch.Tensor:
    """CISPO one row at a time: each row's trained tokens sliced out, their losses summed."""
    total = new.new_zeros(())
    for row in range(new.shape[0]):
        keep = mask[row].bool()
        ratio = torch.exp(torch.clamp(new[row, keep] - old[row, keep], -20.0, 20.0))
        clipped = torch.clamp(ratio, 1.0 - config.low, 1.0 + config.high).detach()
        total = total - (clipped * advantages[row, keep] * new[row, keep]).sum()
    return total * config.dp_size


def per_row_gspo(
    old: torch.Tensor,
    new: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    rollout_ids: Any,
    config: PolicyLossConfig,
) -> torch.Tensor:
    """GSPO per rollout, row by row: each rollout's mean log-ratio gathered from its rows in a dict."""
    rows_of: dict[Any, list[int]] = {}
    for row, rid in enumerate(rollout_ids):
        rows_of.setdefault(rid, []).append(row)
    total = new.new_zeros(())
    for rows in rows_of.values():
        pieces = [
            (new[r, mask[r].bool()], old[r, mask[r].bool()], advantages[r, mask[r].bool()]) for r in rows
        ]
        log_ratio = torch.cat([n - o for n, o, _ in pieces])
        seq = (log_ratio.sum() / max(log_ratio.numel(), 1)).detach()
        for n, _, a in pieces:
            ratio = torch.exp(torch.clamp(n - n.detach() + seq, max=10.0))
            clipped = torch.clamp(ratio, 1.0 - config.low, 1.0 + config.high)
            total = total + torch.maximum(-a * ratio, -a * clipped).sum()
    return total * config.dp_size


def per_row_geo_mean(
    old: torch.Tensor,
    new: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    rollout_ids: Any,
    config: PolicyLossConfig,
) -> torch.Tensor:
    """GMPO per rollout, row by row: each token's pessimistically clipped log-ratio, averaged per rollout."""
    rows_of: dict[Any, list[int]] = {}
    for row, rid in enumerate(rollout_ids):
        rows_of.setdefault(rid, []).append(row)
    total = new.new_zeros(())
    for rows in rows_of.values():
        log_ratios, advs = [], []
        for r in rows:
            keep = mask[r].bool()
            log_ratio = new[r, keep] - old[r, keep]
            sign = torch.sign(advantages[r, keep])
            clamped = torch.clamp(log_ratio, -config.low, config.high)
            log_ratios.append(sign * torch.minimum(sign * log_ratio, sign * clamped))
            advs.append(advantages[r, keep])
        pessimistic = torch.cat(log_ratios)
        ratio = torch.exp(pessimistic.sum() / max(pessimistic.numel(), 1))
        total = total - torch.cat(advs).sum() * ratio
    return total * config.dp_size


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


MIN_SAMPLE_SECONDS = 5e-3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _calls_per_sample(fn: Callable[[], object], device: torch.device) -> int:
    """Smallest power of two of calls that runs >= 5 ms (one warm-up call first)."""
    fn()
    number = 1
    while True:
        _sync(device)
        start = time.perf_counter()
        for _ in range(number):
            fn()
        _sync(device)
        if time.perf_counter() - start >= MIN_SAMPLE_SECONDS:
            return number
        number *= 2


def timed(fns: dict[str, Callable[[], object]], device: torch.device, samples: int) -> dict[str, float]:
    """Best seconds per call of each function over ``samples`` interleaved samples of >= 5 ms."""
    numbers = {name: _calls_per_sample(fn, device) for name, fn in fns.items()}
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(samples):
        for name, fn in fns.items():
            _sync(device)
            start = time.perf_counter()
            for _ in range(numbers[name]):
                fn()
            _sync(device)
            best[name] = min(best[name], (time.perf_counter() - start) / numbers[name])
    return best


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field))


def _mmap_threshold(n_bytes: int) -> None:
    """Serve every allocation of >= ``n_bytes`` with its own mmap, returned to the OS on free.

    glibc otherwise raises the threshold after a large free and keeps freed tensors in its heap, where a
    later call reuses them and the resident set no longer shows what it allocates. A threshold this
    low makes allocation slower, so it is set only while memory is measured.
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    m_mmap_threshold = -3
    libc.mallopt(m_mmap_threshold, n_bytes)
    libc.malloc_trim(0)


def peak_mib(fn: Callable[[], object], device: torch.device) -> float:
    """Peak memory one call of ``fn`` adds, in MiB (see the module docstring for how)."""
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        _sync(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    _mmap_threshold(128 * 1024)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets VmHWM to the current resident set
    before = _rss_kib("VmRSS:")
    fn()
    grown_kib = _rss_kib("VmHWM:") - before
    _mmap_threshold(32 * 2**20)  # the cap glibc's own adjustment stops at, for the next timings
    return grown_kib / 1024


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


def verl_loss(name: str) -> tuple[Callable[..., Any] | None, Any]:
    """verl's policy loss ``name`` and an actor config, or (None, None) without verl."""
    try:
        from verl.trainer.ppo.core_algos import get_policy_loss_fn
        from verl.workers.config import FSDPActorConfig
    except ImportError:
        return None, None
    config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    return get_policy_loss_fn(name), config


def token_sum_step(
    loss_fn: Callable[..., tuple[torch.Tensor, dict[str, Any]]], inputs: dict[str, Any], config: Any
) -> Callable[[], None]:
    """Like :func:`loss_step`, with verl's token-sum aggregation (our losses ignore the mode)."""

    def step() -> None:
        log_prob = inputs["new"].detach().requires_grad_(True)
        loss, _ = loss_fn(
            inputs["old"], log_prob, inputs["advantages"], inputs["mask"], "token-sum", config, None
        )
        loss.backward()

    return step


def loop_step(loop: Callable[[torch.Tensor], torch.Tensor], new: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        loop(new.detach().requires_grad_(True)).backward()

    return step


GOAL_NORM_OVER_LOSS = 0.05
GOAL_LOSS_OVER_VERL = 1.1
HEADER = (
    f"{'rows x tokens':>14} {'norm ms':>8} {'codes ms':>8} {'loop ms':>8} {'loss ms':>8} {'verl ms':>8} "
    f"{'norm/loss':>9} {'<5%':>4} {'loss/verl':>9} {'<=1.1':>5} {'loop/norm':>9} "
    f"{'MiB norm':>8} {'loss':>6} {'verl':>6}"
)


def run_size(
    n_rows: int, n_tokens: int, device: torch.device, samples: int, vanilla: Any, vanilla_config: Any
) -> str:
    """Time one size and measure each function's peak memory; returns its table line."""
    inputs = make_inputs(n_rows, n_tokens, device)
    ids, adv, mask = inputs["rollout_ids"], inputs["advantages"], inputs["mask"]
    codes = torch.as_tensor(np.arange(n_rows) // ROWS_PER_ROLLOUT, device=device)
    normalized = normalize_advantages_by_rollout(adv, mask, ids, divisor="rollouts")
    fns: dict[str, Callable[[], object]] = {
        "norm": lambda: normalize_advantages_by_rollout(adv, mask, ids, divisor="rollouts"),
        "codes": lambda: normalize_advantages_by_rollout(
            adv, mask, ids, divisor="rollouts", rollout_codes=codes
        ),
        "loop": lambda: per_row_normalize(adv, mask, ids, n_rows),
        "ours": loss_step(
            compute_policy_loss_per_rollout_mean, {**inputs, "advantages": normalized}, PolicyLossConfig()
        ),
    }
    if vanilla is not None:
        fns["verl"] = loss_step(vanilla, {**inputs, "advantages": normalized}, vanilla_config)
    best = timed(fns, device, samples)
    peak = {name: peak_mib(fns[name], device) for name in ("norm", "ours", "verl") if name in fns}
    norm, ours, theirs = best["norm"], best["ours"], best.get("verl", float("nan"))

    def verdict(ok: bool) -> str:
        return "ok" if ok else "FAIL"

    return (
        f"{f'{n_rows} x {n_tokens}':>14} {norm * 1e3:8.3f} {best['codes'] * 1e3:8.3f} {best['loop'] * 1e3:8.3f} "
        f"{ours * 1e3:8.2f} {theirs * 1e3:8.2f} {norm / ours:9.3f} {verdict(norm / ours < GOAL_NORM_OVER_LOSS):>4} "
        f"{ours / theirs:9.3f} {verdict(ours / theirs <= GOAL_LOSS_OVER_VERL):>5} {best['loop'] / norm:9.1f} "
        f"{peak['norm']:8.1f} {peak['ours']:6.0f} {peak.get('verl', float('nan')):6.0f}"
    )


LOSS_HEADER = (
    f"{'rows x tokens':>14} {'cispo ms':>8} {'verl':>8} {'loop':>8} {'gspo ms':>8} {'verl':>8} {'loop':>8} "
    f"{'cispo/verl':>10} {'<=1.1':>5} {'gspo/verl':>9} {'<=1.1':>5} {'loop/ours':>9} {'':>5} "
    f"{'MiB cispo':>9} {'gspo':>6} {'verl':>6}"
)


def rollout_normalized_inputs(
    n_rows: int, n_tokens: int, device: torch.device
) -> tuple[dict[str, Any], torch.Tensor]:
    """:func:`make_inputs` with rollout-normalised advantages, and each row's rollout index."""
    inputs = make_inputs(n_rows, n_tokens, device)
    normalized = normalize_advantages_by_rollout(
        inputs["advantages"], inputs["mask"], inputs["rollout_ids"], divisor="rollouts"
    )
    index = torch.as_tensor(np.arange(n_rows) // ROWS_PER_ROLLOUT, device=device)
    return {**inputs, "advantages": normalized}, index


def run_new_losses(n_rows: int, n_tokens: int, device: torch.device, samples: int) -> str:
    """Time CISPO and GSPO per rollout against verl's cispo/gspo and per-row loops; its table line."""
    inputs, index = rollout_normalized_inputs(n_rows, n_tokens, device)
    ids, mask, old, adv = inputs["rollout_ids"], inputs["mask"], inputs["old"], inputs["advantages"]
    config = PolicyLossConfig()

    def gspo(*args: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        return compute_policy_loss_gspo_per_rollout(*args, rollout_index=index)

    fns: dict[str, Callable[[], object]] = {
        "cispo": token_sum_step(compute_policy_loss_cispo_per_rollout_mean, inputs, config),
        "cispo loop": loop_step(lambda new: per_row_cispo(old, new, adv, mask, config), inputs["new"]),
        "gspo": token_sum_step(gspo, inputs, config),
        "gspo loop": loop_step(lambda new: per_row_gspo(old, new, adv, mask, ids, config), inputs["new"]),
    }
    for name in ("cispo", "gspo"):
        theirs, their_config = verl_loss(name)
        if theirs is not None:
            fns[f"verl {name}"] = token_sum_step(theirs, inputs, their_config)
    best = timed(fns, device, samples)
    peak = {name: peak_mib(fns[name], device) for name in ("cispo", "gspo", "verl gspo") if name in fns}
    nan = float("nan")
    cispo_verl, gspo_verl = (
        best["cispo"] / best.get("verl cispo", nan),
        best["gspo"] / best.get("verl gspo", nan),
    )

    def verdict(ok: bool) -> str:
        return "ok" if ok else "FAIL"

    loops = f"{best['cispo loop'] / best['cispo']:.0f}/{best['gspo loop'] / best['gspo']:.0f}"
    return (
        f"{f'{n_rows} x {n_tokens}':>14} {best['cispo'] * 1e3:8.2f} {best.get('verl cispo', nan) * 1e3:8.2f} "
        f"{best['cispo loop'] * 1e3:8.2f} {best['gspo'] * 1e3:8.2f} {best.get('verl gspo', nan) * 1e3:8.2f} "
        f"{best['gspo loop'] * 1e3:8.2f} {cispo_verl:10.3f} {verdict(cispo_verl <= GOAL_LOSS_OVER_VERL):>5} "
        f"{gspo_verl:9.3f} {verdict(gspo_verl <= GOAL_LOSS_OVER_VERL):>5} {loops:>9} {'':>5} "
        f"{peak['cispo']:9.0f} {peak['gspo']:6.0f} {peak.get('verl gspo', nan):6.0f}"
    )


GEO_MEAN_HEADER = (
    f"{'rows x tokens':>14} {'geo ms':>8} {'verl':>8} {'loop':>8} {'geo/verl':>9} {'<=1.1':>5} "
    f"{'loop/ours':>9} {'MiB geo':>8} {'verl':>6}"
)


def run_geo_mean(n_rows: int, n_tokens: int, device: torch.device, samples: int) -> str:
    """Time geo_mean_per_rollout against verl's geo_mean and a per-rollout loop; its table line."""
    inputs, index = rollout_normalized_inputs(n_rows, n_tokens, device)
    ids, mask, old, adv = inputs["rollout_ids"], inputs["mask"], inputs["old"], inputs["advantages"]
    config = PolicyLossConfig()

    def geo_mean(*args: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        return compute_policy_loss_geo_mean_per_rollout(*args, rollout_index=index)

    fns: dict[str, Callable[[], object]] = {
        "geo": token_sum_step(geo_mean, inputs, config),
        "loop": loop_step(lambda new: per_row_geo_mean(old, new, adv, mask, ids, config), inputs["new"]),
    }
    theirs, their_config = verl_loss("geo_mean")
    if theirs is not None:
        fns["verl"] = token_sum_step(theirs, inputs, their_config)
    best = timed(fns, device, samples)
    peak = {name: peak_mib(fns[name], device) for name in ("geo", "verl") if name in fns}
    nan = float("nan")
    over_verl = best["geo"] / best.get("verl", nan)
    verdict = "ok" if over_verl <= GOAL_LOSS_OVER_VERL else "FAIL"
    return (
        f"{f'{n_rows} x {n_tokens}':>14} {best['geo'] * 1e3:8.2f} {best.get('verl', nan) * 1e3:8.2f} "
        f"{best['loop'] * 1e3:8.2f} {over_verl:9.3f} {verdict:>5} {best['loop'] / best['geo']:9.0f} "
        f"{peak['geo']:8.0f} {peak.get('verl', nan):6.0f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes only (seconds)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--samples", type=int, default=20, help="timed samples per function (best is kept)")
    args = parser.parse_args()
    device = torch.device(args.device)
    vanilla, vanilla_config = verl_loss("vanilla")
    print(
        f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} rows/rollout={ROWS_PER_ROLLOUT}"
    )
    if vanilla is None:
        print("verl not installed: the vanilla-loss column is skipped")
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    print(HEADER)
    for n_rows, n_tokens in sizes:
        print(run_size(n_rows, n_tokens, device, args.samples, vanilla, vanilla_config), flush=True)
    print(LOSS_HEADER)
    for n_rows, n_tokens in sizes:
        print(run_new_losses(n_rows, n_tokens, device, args.samples), flush=True)
    print(GEO_MEAN_HEADER)
    for n_rows, n_tokens in sizes:
        print(run_geo_mean(n_rows, n_tokens, device, args.samples), flush=True)


if __name__ == "__main__":
    main()
