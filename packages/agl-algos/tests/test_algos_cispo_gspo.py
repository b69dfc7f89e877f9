"""CISPO and GSPO per rollout: exact values, references, gradients, and one rollout = one vote."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from algos_reference import cispo_token_loss, gspo_per_rollout_loop
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_algos import (
    ROLLOUT_LOSS_AGG_MODES,
    PolicyLossConfig,
    RolloutDivisor,
    RolloutLossAggMode,
    compute_policy_loss_cispo_per_rollout_mean,
    compute_policy_loss_geo_mean_per_rollout,
    compute_policy_loss_gspo_per_rollout,
    compute_policy_loss_per_rollout_mean,
    normalize_advantages_by_rollout,
    rollout_index_context,
    rollout_index_of,
)

CONFIG = PolicyLossConfig(clip_ratio=0.2)
LossFn = Callable[..., tuple[torch.Tensor, dict[str, Any]]]
PER_ROLLOUT_LOSSES: dict[str, LossFn] = {
    "per_rollout_mean": compute_policy_loss_per_rollout_mean,
    "cispo_per_rollout_mean": compute_policy_loss_cispo_per_rollout_mean,
    "gspo_per_rollout": compute_policy_loss_gspo_per_rollout,
    "geo_mean_per_rollout": compute_policy_loss_geo_mean_per_rollout,
}


def test_cispo_hand_computed_loss_gradient_and_metrics() -> None:
    # ratios 1.5, 0.5, 1 clipped to [0.8, 1.2] -> 1.2, 0.8, 1; A = 1, -1, 2; loss = sum -clip(r) A log_prob
    # = -1.2 ln 1.5 + 0.8 ln 0.5 - 0 = -0.4865581 - 0.5545177 = -1.0410758; d/dlog_prob = -clip(r) A
    # = -1.2, 0.8, -2; clipfrac 2/3; ppo_kl = -(ln 1.5 + ln 0.5 + 0) / 3 = -ln 0.75 / 3 = 0.0958940
    log_prob = torch.tensor([[math.log(1.5), math.log(0.5), 0.0]], requires_grad=True)
    loss, metrics = compute_policy_loss_cispo_per_rollout_mean(
        torch.zeros(1, 3), log_prob, torch.tensor([[1.0, -1.0, 2.0]]), torch.ones(1, 3), config=CONFIG
    )
    loss.backward()
    assert loss.item() == pytest.approx(-1.0410758, abs=1e-6)
    assert log_prob.grad is not None
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-1.2, 0.8, -2.0]]), rtol=0, atol=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 3, abs=1e-6)
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0958940, abs=1e-6)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0


def test_cispo_scales_by_dp_size_and_importance_weights_and_skips_masked_tokens() -> None:
    # ratio 1 everywhere: loss = -A * log_prob * w summed over the 2 trained tokens, x dp 3
    # = -(2 * -0.5 * 0.5 + 1 * -1 * 2) * 3 = -(-0.5 - 2) * 3 = 7.5
    log_prob = torch.tensor([[-0.5, -1.0, 1e30]])
    loss, _ = compute_policy_loss_cispo_per_rollout_mean(
        log_prob,
        log_prob,
        torch.tensor([[2.0, 1.0, 1.0]]),
        torch.tensor([[1, 1, 0]]),
        config={"clip_ratio": 0.2, "global_batch_info": {"dp_size": 3}},
        rollout_is_weights=torch.tensor([[0.5, 2.0, 1.0]]),
    )
    assert loss.item() == pytest.approx(7.5)


@settings(max_examples=80, deadline=None)
@given(st.floats(-3, 0), st.floats(-3, 3), st.floats(-2, 2), st.floats(0, 0.9), st.floats(0, 2))
def test_cispo_token_loss_matches_the_scalar_reference(
    old: float, new: float, adv: float, low: float, high: float
) -> None:
    config = PolicyLossConfig(clip_ratio_low=low, clip_ratio_high=high)
    loss, _ = compute_policy_loss_cispo_per_rollout_mean(
        torch.tensor([[old]]), torch.tensor([[new]]), torch.tensor([[adv]]), torch.ones(1, 1), config=config
    )
    assert loss.item() == pytest.approx(cispo_token_loss(old, new, adv, low, high), rel=1e-4, abs=1e-5)


def gspo_hand_batch() -> tuple[torch.Tensor, ...]:
    """Rollout X = rows 0 and 1 (log-ratios 0.3, 0.0 | 0.0), rollout Y = row 2 (-0.3, 0.3); A_X 0.5, A_Y -1."""
    old = torch.zeros(3, 2)
    new = torch.tensor([[0.3, 0.0], [0.0, 7.0], [-0.3, 0.3]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    adv = torch.tensor([[0.5, 0.5], [0.5, 0.5], [-1.0, -1.0]]) * mask
    return old, new, adv, mask


def test_gspo_per_rollout_hand_computed_loss_and_gradient() -> None:
    # X: mean log-ratio (0.3 + 0 + 0) / 3 = 0.1 over both rows, s_X = e^0.1 = 1.1051709 in [0.8, 1.2];
    # Y: mean 0, s_Y = 1. Loss = 3 tokens x -0.5 x 1.1051709 + 2 tokens x 1 x 1 = -1.6577564 + 2 = 0.3422436;
    # gradient -A s: -0.5525855 on X's tokens, 1 on Y's, 0 on the padding
    old, new, adv, mask = gspo_hand_batch()
    log_prob = new.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss_gspo_per_rollout(
        old, log_prob, adv, mask, config=CONFIG, rollout_index=torch.tensor([4, 4, 1])
    )
    loss.backward()
    assert loss.item() == pytest.approx(0.3422436, abs=1e-6)
    assert log_prob.grad is not None
    expected = torch.tensor([[-0.5525855] * 2, [-0.5525855, 0.0], [1.0, 1.0]])
    torch.testing.assert_close(log_prob.grad, expected, rtol=0, atol=1e-6)
    # ppo_kl = -(0.3 + 0 + 0 - 0.3 + 0.3) / 5 = -0.06
    assert metrics == pytest.approx(
        {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": -0.06, "actor/pg_clipfrac_lower": 0.0}
    )


def test_gspo_per_row_ratios_differ_from_the_per_rollout_ratio() -> None:
    # one rollout per row, as verl's gspo: row 0's s = e^0.15 = 1.1618342, row 1's s = e^0 = 1:
    # X's loss = 2 x -0.5 x 1.1618342 - 0.5 = -1.6618342 (not -1.6577564); Y unchanged (+2) -> 0.3381658
    old, new, adv, mask = gspo_hand_batch()
    loss, _ = compute_policy_loss_gspo_per_rollout(
        old, new, adv, mask, config=CONFIG, rollout_index=torch.tensor([0, 1, 2])
    )
    assert loss.item() == pytest.approx(0.3381658, abs=1e-6)


def test_gspo_clipped_rollout_gives_the_bound_and_no_gradient() -> None:
    # mean log-ratio 0.5: s = 1.6487213 > 1.2 with A = 1 > 0 -> loss -1.2 per token, gradient 0, clipfrac 1
    log_prob = torch.tensor([[0.4, 0.6]], requires_grad=True)
    loss, metrics = compute_policy_loss_gspo_per_rollout(
        torch.zeros(1, 2),
        log_prob,
        torch.ones(1, 2),
        torch.ones(1, 2),
        config=CONFIG,
        rollout_index=torch.tensor([0]),
    )
    loss.backward()
    assert loss.item() == pytest.approx(-2.4, abs=1e-6)
    assert log_prob.grad is not None and log_prob.grad.tolist() == [[0.0, 0.0]]
    assert metrics["actor/pg_clipfrac"] == 1.0


def test_gspo_log_ratio_is_clamped_above_at_ten() -> None:
    # mean log-ratio 30 -> s = e^10 = 22026.466; A = -1e-3 < 0 so the unclipped term -A s = 22.026466 wins
    loss, _ = compute_policy_loss_gspo_per_rollout(
        torch.zeros(1, 1), torch.full((1, 1), 30.0), torch.full((1, 1), -1e-3), torch.ones(1, 1),
        config=CONFIG, rollout_index=torch.tensor([0]),
    )  # fmt: skip
    assert loss.item() == pytest.approx(22.026466, rel=1e-6)


def test_gspo_reads_the_context_index_and_prefers_an_explicit_one() -> None:
    old, new, adv, mask = gspo_hand_batch()
    per_rollout, per_row = torch.tensor([4, 4, 1]), torch.tensor([0, 1, 2])
    explicit, _ = compute_policy_loss_gspo_per_rollout(
        old, new, adv, mask, config=CONFIG, rollout_index=per_rollout
    )
    with rollout_index_context(per_row):
        with rollout_index_context(per_rollout):
            from_context, _ = compute_policy_loss_gspo_per_rollout(old, new, adv, mask, config=CONFIG)
        restored, _ = compute_policy_loss_gspo_per_rollout(old, new, adv, mask, config=CONFIG)
        overridden, _ = compute_policy_loss_gspo_per_rollout(
            old, new, adv, mask, config=CONFIG, rollout_index=per_rollout
        )
    assert from_context.item() == explicit.item() == overridden.item()
    assert restored.item() == pytest.approx(0.3381658, abs=1e-6)  # the per-row value above


def test_gspo_without_a_rollout_index_says_how_to_pass_one() -> None:
    with pytest.raises(ValueError, match=r"rollout_index=.*batch\['rollout_index'\].*RolloutIndexLoss"):
        compute_policy_loss_gspo_per_rollout(
            torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), config=CONFIG
        )


@pytest.mark.parametrize(
    "index", [torch.tensor([0, 1]), torch.tensor([0.0, 1.0, 1.0]), torch.tensor([[0, 1, 1]])]
)
def test_gspo_refuses_a_rollout_index_of_the_wrong_shape_or_dtype(index: torch.Tensor) -> None:
    with pytest.raises(ValueError, match=r"rollout_index must be an integer tensor of shape \(3,\)"):
        compute_policy_loss_gspo_per_rollout(
            torch.zeros(3, 1),
            torch.zeros(3, 1),
            torch.ones(3, 1),
            torch.ones(3, 1),
            config=CONFIG,
            rollout_index=index,
        )


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 10_000), st.integers(1, 6), st.integers(1, 5), st.floats(0.05, 0.5), st.floats(0.05, 0.5)
)
def test_gspo_matches_the_loop_reference(
    seed: int, n_rows: int, length: int, low: float, high: float
) -> None:
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(n_rows, length, generator=gen, dtype=torch.float64) * 3
    new = old + (torch.rand(n_rows, length, generator=gen, dtype=torch.float64) - 0.5)
    adv = torch.randn(n_rows, length, generator=gen, dtype=torch.float64)
    mask = torch.rand(n_rows, length, generator=gen) > 0.3
    index = torch.randint(0, 3, (n_rows,), generator=gen)
    log_prob = new.clone().requires_grad_(True)
    config = PolicyLossConfig(clip_ratio_low=low, clip_ratio_high=high)
    loss, _ = compute_policy_loss_gspo_per_rollout(
        old, log_prob, adv, mask, config=config, rollout_index=index
    )
    loss.backward()
    expected_loss, expected_grad = gspo_per_rollout_loop(old, new, adv, mask, index.tolist(), low, high)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-9, abs=1e-9)
    assert log_prob.grad is not None
    torch.testing.assert_close(log_prob.grad, expected_grad)


@pytest.mark.parametrize("seed", range(4))
def test_cispo_passes_gradcheck_at_a_fixed_ratio(seed: int) -> None:
    # CISPO detaches the clipped ratio, so its gradient is that of the loss with the ratio held fixed;
    # moving old_log_prob with log_prob holds it fixed, and then finite differences must agree.
    gen = torch.Generator().manual_seed(seed)
    gap = torch.randn(3, 4, generator=gen, dtype=torch.float64) * 0.5  # ratios e^gap, some clipped
    mask = torch.rand(3, 4, generator=gen) > 0.2
    inputs = tuple(
        torch.randn(3, 4, generator=gen, dtype=torch.float64).requires_grad_(True) for _ in range(3)
    )

    def cispo(log_prob: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        loss, _ = compute_policy_loss_cispo_per_rollout_mean(
            log_prob - gap, log_prob, advantages, mask, config=CONFIG, rollout_is_weights=weights
        )
        return loss

    assert torch.autograd.gradcheck(cispo, inputs)


@pytest.mark.parametrize(("seed", "spread"), [(0, 0.05), (1, 0.05), (2, 0.05), (3, 2.0), (4, 2.0)])
def test_gspo_passes_gradcheck_with_rollout_constant_advantages(seed: int, spread: float) -> None:
    # With one advantage per rollout, the token-level surrogate has the gradient of the true sequence
    # objective sum_r -A_r n_r clip(s_r(theta)), s_r = exp(mean log-ratio over all the rollout's rows), so
    # finite differences of the loss's value must match autograd (spread 2.0: some rollouts clipped).
    gen = torch.Generator().manual_seed(seed)
    index = torch.tensor([0, 0, 1, 2, 2, 2])
    mask = torch.rand(6, 3, generator=gen) > 0.2
    old = -torch.rand(6, 3, generator=gen, dtype=torch.float64)
    adv = torch.randn(3, generator=gen, dtype=torch.float64)[index].unsqueeze(-1).expand(6, 3)
    shift = (torch.rand(3, generator=gen, dtype=torch.float64) - 0.5) * spread
    log_prob = (old + shift[index].unsqueeze(-1)).requires_grad_(True)

    def gspo(log_prob: torch.Tensor) -> torch.Tensor:
        loss, _ = compute_policy_loss_gspo_per_rollout(
            old, log_prob, adv, mask, config=CONFIG, rollout_index=index
        )
        return loss

    assert torch.autograd.gradcheck(gspo, (log_prob,))


@dataclass(frozen=True)
class SplitBatch:
    """Rollouts laid out as rows: tensors (N, T), the rollout of each row, and where each token went."""

    old: torch.Tensor
    new: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    rollout_of_row: list[int]
    token_at: list[tuple[int, int]]  # (row, column) of each token, rollout by rollout


def split_rollouts(
    old: list[list[float]], new: list[list[float]], advantages: list[float], splits: list[int]
) -> SplitBatch:
    """Rollout r's tokens cut into ``splits[r]`` consecutive rows (some empty when it has fewer tokens)."""
    rows: list[tuple[int, list[int]]] = []
    for r, tokens in enumerate(old):
        rows += [(r, chunk.tolist()) for chunk in np.array_split(np.arange(len(tokens)), splits[r])]
    width = max(1, *(len(chunk) for _, chunk in rows))
    shape = (len(rows), width)
    out_old, out_new = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
    out_adv, mask = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.int64)
    token_at: list[tuple[int, int]] = []
    for row, (r, chunk) in enumerate(rows):
        for col, t in enumerate(chunk):
            out_old[row, col], out_new[row, col] = old[r][t], new[r][t]
            out_adv[row, col], mask[row, col] = advantages[r], 1
            token_at.append((row, col))
    return SplitBatch(out_old, out_new, out_adv, mask, [r for r, _ in rows], token_at)


def loss_and_token_grads(
    loss_fn: LossFn,
    batch: SplitBatch,
    divisor: RolloutDivisor,
    loss_agg_mode: RolloutLossAggMode = "seq-mean-token-mean",
) -> tuple[float, list[float]]:
    advantages = normalize_advantages_by_rollout(
        batch.advantages,
        batch.mask,
        batch.rollout_of_row,
        divisor=divisor,
        num_trained_rows=len(batch.rollout_of_row),
        loss_agg_mode=loss_agg_mode,
        loss_scale_factor=8,
    )
    log_prob = batch.new.clone().requires_grad_(True)
    with rollout_index_context(torch.tensor(batch.rollout_of_row)):
        loss, _ = loss_fn(batch.old, log_prob, advantages, batch.mask, config=CONFIG)
    loss.backward()
    assert log_prob.grad is not None
    return loss.item(), [log_prob.grad[row, col].item() for row, col in batch.token_at]


@st.composite
def rollouts(draw: st.DrawFn) -> tuple[list[list[float]], list[list[float]], list[float]]:
    """1-4 rollouts of 1-8 tokens: old log-probs, new ones within ±0.6, one advantage per rollout."""
    old: list[list[float]] = []
    new: list[list[float]] = []
    for _ in range(draw(st.integers(1, 4))):
        n_tokens = draw(st.integers(1, 8))
        tokens = draw(st.lists(st.floats(-3, 0), min_size=n_tokens, max_size=n_tokens))
        deltas = draw(st.lists(st.floats(-0.6, 0.6), min_size=n_tokens, max_size=n_tokens))
        old.append(tokens)
        new.append([t + d for t, d in zip(tokens, deltas, strict=True)])
    return old, new, draw(st.lists(st.floats(-2, 2), min_size=len(old), max_size=len(old)))


@pytest.mark.parametrize("loss_agg_mode", ROLLOUT_LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_name", sorted(PER_ROLLOUT_LOSSES))
@settings(max_examples=20, deadline=None)
@given(batch=rollouts(), data=st.data())
def test_a_rollout_split_into_1_2_or_5_rows_gives_the_same_loss_and_gradient(
    loss_name: str,
    loss_agg_mode: RolloutLossAggMode,
    batch: tuple[list[list[float]], list[list[float]], list[float]],
    data: st.DataObject,
) -> None:
    old, new, advantages = batch
    splits = data.draw(st.lists(st.sampled_from([1, 2, 5]), min_size=len(old), max_size=len(old)))
    loss_fn = PER_ROLLOUT_LOSSES[loss_name]
    whole = split_rollouts(old, new, advantages, [1] * len(old))
    split = split_rollouts(old, new, advantages, splits)
    one_row_loss, one_row_grads = loss_and_token_grads(loss_fn, whole, "rollouts", loss_agg_mode)
    split_loss, split_grads = loss_and_token_grads(loss_fn, split, "rollouts", loss_agg_mode)
    assert split_loss == pytest.approx(one_row_loss, rel=1e-9, abs=1e-12)
    assert split_grads == pytest.approx(one_row_grads, rel=1e-9, abs=1e-12)
    # 1.0.2's rows divisor scales the same loss by rollouts / rows (token-sum has no count)
    rows_loss, _ = loss_and_token_grads(loss_fn, split, "rows", loss_agg_mode)
    n_rows = len(split.rollout_of_row) if loss_agg_mode != "token-sum" else len(old)
    assert rows_loss == pytest.approx(split_loss * len(old) / n_rows, rel=1e-9, abs=1e-12)


def test_geo_mean_per_rollout_hand_computed_loss_gradient_and_metrics() -> None:
    # rollout 0 spans two rows (log-ratios 0.1 | 0.5, -0.1), advantage +1 per token; rollout 1 one row
    # (log-ratio -0.5), advantage -2. Clip 0.2: for A > 0 the pessimistic side caps 0.5 at 0.2; for A < 0
    # -0.5 is raised to -0.2. ratio_0 = exp((0.1 + 0.2 - 0.1) / 3), ratio_1 = exp(-0.2).
    old = torch.zeros(3, 2, dtype=torch.float64)
    new = torch.tensor([[0.1, 0.0], [0.5, -0.1], [-0.5, 0.0]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[1.0, 0.0], [1.0, 1.0], [-2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0], [1, 1], [1, 0]])
    loss, metrics = compute_policy_loss_geo_mean_per_rollout(
        old, new, advantages, mask, config=CONFIG, rollout_index=torch.tensor([4, 4, 9])
    )
    ratio_0, ratio_1 = math.exp(0.2 / 3), math.exp(-0.2)
    assert loss.item() == pytest.approx(-3 * ratio_0 + 2 * ratio_1, rel=1e-12)
    loss.backward()
    assert new.grad is not None
    # d loss / d log_prob: -A_sum_r * ratio_r / n_r for unclipped tokens, 0 for the clipped ones
    expected = [[-3 * ratio_0 / 3, 0.0], [0.0, -3 * ratio_0 / 3], [0.0, 0.0]]
    assert new.grad.tolist() == [pytest.approx(row, rel=1e-12, abs=1e-15) for row in expected]
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / 4)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 4)


def test_rollout_index_of_numbers_rollouts_in_order_of_first_appearance() -> None:
    assert rollout_index_of(["b", "a", "b", "c", "a"]).tolist() == [0, 1, 0, 2, 1]
    assert rollout_index_of(np.array([7, 7, 3])).dtype == torch.int64
