"""normalize_advantages_by_rollout and the per-rollout-mean PPO loss: exact values and properties."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from algos_reference import normalize_by_rollout_loop, ppo_token_loss
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_algos import (
    PolicyLossConfig,
    RolloutDivisor,
    compute_policy_loss_per_rollout_mean,
    normalize_advantages_by_rollout,
    rollout_layout,
    rollout_token_totals,
    rows_per_rollout_metrics,
)

CONFIG = PolicyLossConfig(clip_ratio=0.2)


def test_every_rollout_gets_mass_one_over_trained_rows() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    out = normalize_advantages_by_rollout(
        torch.ones(3, 3), mask, ["A", "A", "B"], divisor="rows", num_trained_rows=3
    )
    assert torch.equal(out, torch.full((3, 3), 1 / 9))
    masses = [(out[:2] * mask[:2]).sum().item(), (out[2] * mask[2]).sum().item()]
    assert masses == pytest.approx([1 / 3, 1 / 3], abs=1e-7)


@pytest.mark.parametrize(
    ("loss_agg_mode", "a_row", "b_row"),
    [
        # rollouts A (two rows, 3 tokens) and B (one row, 3 tokens); advantage 6 everywhere; 2 rollouts
        ("seq-mean-token-mean", 6 / (3 * 2), 6 / (3 * 2)),
        ("token-mean", 6 / (3 * 2), 6 / (3 * 2)),
        ("seq-mean-token-sum", 6 / 2, 6 / 2),
        ("seq-mean-token-sum-norm", 6 / (2 * 4), 6 / (2 * 4)),
        ("token-sum", 6.0, 6.0),
    ],
)
def test_each_loss_agg_mode_takes_rollouts_as_its_sequences(
    loss_agg_mode: str, a_row: float, b_row: float
) -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    out = normalize_advantages_by_rollout(
        torch.full((3, 3), 6.0),
        mask,
        ["A", "A", "B"],
        loss_agg_mode=loss_agg_mode,  # pyright: ignore[reportArgumentType]
        loss_scale_factor=4,
    )
    assert out.tolist() == [[a_row] * 3, [a_row] * 3, [b_row] * 3]


def test_seq_mean_token_sum_norm_needs_a_positive_loss_scale_factor() -> None:
    with pytest.raises(ValueError, match=r"needs loss_scale_factor > 0, got None"):
        normalize_advantages_by_rollout(
            torch.ones(1, 2), torch.ones(1, 2), ["a"], loss_agg_mode="seq-mean-token-sum-norm"
        )


def test_an_unknown_loss_agg_mode_is_refused_with_the_supported_ones() -> None:
    with pytest.raises(
        ValueError, match=r"Unsupported loss_agg_mode: 'seq-sum'. Supported: \['seq-mean-token-mean'"
    ):
        normalize_advantages_by_rollout(
            torch.ones(1, 2),
            torch.ones(1, 2),
            ["a"],
            loss_agg_mode="seq-sum",  # pyright: ignore[reportArgumentType]
        )


def test_divisor_is_clamped_at_one_for_a_rollout_without_tokens() -> None:
    mask = torch.tensor([[0, 0], [1, 1]])
    out = normalize_advantages_by_rollout(
        torch.tensor([[4.0, 4.0], [4.0, 4.0]]), mask, ["e", "f"], divisor="rows", num_trained_rows=1
    )
    assert out.tolist() == [[4.0, 4.0], [2.0, 2.0]]


def test_normalization_keeps_dtype_and_does_not_modify_its_input() -> None:
    advantages = torch.ones(2, 2, dtype=torch.float64)
    before = advantages.clone()
    out = normalize_advantages_by_rollout(
        advantages, torch.ones(2, 2), [1, 2], divisor="rows", num_trained_rows=2
    )
    assert out.dtype == torch.float64 and torch.equal(advantages, before)


def test_normalization_rejects_a_rollout_id_count_other_than_rows() -> None:
    with pytest.raises(ValueError, match=r"rollout_ids length \(1\) must match advantages rows \(2\)"):
        normalize_advantages_by_rollout(
            torch.ones(2, 2), torch.ones(2, 2), ["a"], divisor="rows", num_trained_rows=2
        )


@pytest.mark.parametrize("num_trained_rows", [0, -3])
def test_normalization_rejects_non_positive_num_trained_rows(num_trained_rows: int) -> None:
    with pytest.raises(ValueError, match="num_trained_rows must be positive"):
        normalize_advantages_by_rollout(
            torch.ones(1, 2), torch.ones(1, 2), ["a"], divisor="rows", num_trained_rows=num_trained_rows
        )


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_normalization_matches_the_per_row_loop(data: st.DataObject) -> None:
    n_rows, length = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 6))
    ids = data.draw(st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=n_rows, max_size=n_rows))
    mask = torch.tensor(
        data.draw(
            st.lists(
                st.lists(st.integers(0, 1), min_size=length, max_size=length),
                min_size=n_rows,
                max_size=n_rows,
            )
        )
    )
    advantages = torch.randn(
        n_rows, length, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    )
    n_trained = data.draw(st.integers(1, 50))
    out = normalize_advantages_by_rollout(advantages, mask, ids, divisor="rows", num_trained_rows=n_trained)
    torch.testing.assert_close(out, normalize_by_rollout_loop(advantages, mask, ids, n_trained))


def test_precomputed_rollout_codes_give_the_spec_masses() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    codes = torch.tensor([0, 0, 1])
    out = normalize_advantages_by_rollout(
        torch.ones(3, 3), mask, ["A", "A", "B"], divisor="rows", num_trained_rows=3, rollout_codes=codes
    )
    assert torch.equal(out, torch.full((3, 3), 1 / 9))


def test_rollout_codes_from_the_advantage_layout_are_accepted_as_numpy() -> None:
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]])
    layout = rollout_layout(["x", "y", "x"], ["g"] * 3, torch.zeros(3))
    out = normalize_advantages_by_rollout(
        torch.ones(3, 2),
        mask,
        ["x", "y", "x"],
        divisor="rows",
        num_trained_rows=1,
        rollout_codes=layout.rollout_of_row,
    )
    assert out.tolist() == [[0.5, 0.5], [1.0, 1.0], [0.5, 0.5]]


@pytest.mark.parametrize(
    ("codes", "match"),
    [
        (torch.tensor([0, 1]), r"int64 of shape \(3,\)"),
        (torch.tensor([0.0, 1.0, 1.0]), r"int64 of shape \(3,\)"),
        (torch.tensor([0, 1, 1], dtype=torch.int32), r"int64 of shape \(3,\)"),
        (torch.tensor([0, -1, 1]), r"in \[0, 3\)"),
        (torch.tensor([0, 3, 1]), r"in \[0, 3\)"),
    ],
)
def test_invalid_rollout_codes_are_a_value_error_naming_them(codes: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=rf"rollout_codes must be .*{match}"):
        normalize_advantages_by_rollout(
            torch.ones(3, 2),
            torch.ones(3, 2),
            ["a", "b", "b"],
            divisor="rows",
            num_trained_rows=1,
            rollout_codes=codes,
        )


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_normalization_with_and_without_precomputed_codes_is_identical(data: st.DataObject) -> None:
    n_rows, length = data.draw(st.integers(0, 12)), data.draw(st.integers(1, 6))
    ids = data.draw(st.lists(st.sampled_from(["a", "b", 3, 4]), min_size=n_rows, max_size=n_rows))
    mask = torch.tensor(
        data.draw(st.lists(st.integers(0, 1), min_size=n_rows * length, max_size=n_rows * length))
    ).reshape(n_rows, length)
    advantages = torch.randn(
        n_rows, length, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    )
    codes = rollout_layout(ids, [0] * n_rows, torch.zeros(n_rows)).rollout_of_row
    without = normalize_advantages_by_rollout(
        advantages, mask, ids, divisor="rows", num_trained_rows=n_rows + 1
    )
    with_codes = normalize_advantages_by_rollout(
        advantages, mask, ids, divisor="rows", num_trained_rows=n_rows + 1, rollout_codes=codes
    )
    assert torch.equal(without, with_codes)


def loss_of(
    old: list[float], new: list[float], adv: list[float], config: object = CONFIG, **kwargs: object
) -> tuple[float, dict[str, float]]:
    loss, metrics = compute_policy_loss_per_rollout_mean(
        torch.tensor([old]),
        torch.tensor([new]),
        torch.tensor([adv]),
        torch.ones(1, len(adv)),
        config=config,
        **kwargs,  # type: ignore[arg-type]
    )
    return loss.item(), metrics


def test_ratio_one_gives_minus_the_masked_advantage_sum_times_dp_size() -> None:
    advantages = torch.tensor([[0.5, -0.25, 9.0]])
    mask = torch.tensor([[1, 1, 0]])
    config = SimpleNamespace(
        clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, global_batch_info={"dp_size": 2}
    )
    loss, metrics = compute_policy_loss_per_rollout_mean(
        torch.zeros(1, 3), torch.zeros(1, 3), advantages, mask, config=config
    )
    assert loss.item() == -0.5
    assert metrics == {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": 0.0, "actor/pg_clipfrac_lower": 0.0}


def test_positive_advantage_is_clipped_at_one_plus_high() -> None:
    loss, metrics = loss_of([0.0], [math.log(1.5)], [1.0])
    assert loss == pytest.approx(-1.2, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1.0)


def test_negative_advantage_is_clipped_at_one_minus_low() -> None:
    loss, metrics = loss_of([0.0], [math.log(0.5)], [-1.0])
    assert loss == pytest.approx(0.8, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1.0)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0


def test_dual_clip_bounds_a_negative_advantage_at_clip_ratio_c() -> None:
    loss, metrics = loss_of([0.0], [math.log(4.0)], [-1.0])
    assert loss == pytest.approx(3.0, abs=1e-6)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1.0)


def test_asymmetric_clip_uses_low_and_high_separately() -> None:
    config = PolicyLossConfig(clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.5)
    high, _ = loss_of([0.0], [math.log(2.0)], [1.0], config)
    low, _ = loss_of([0.0], [math.log(0.5)], [-1.0], config)
    assert (high, low) == (pytest.approx(-1.5, abs=1e-6), pytest.approx(0.9, abs=1e-6))


def test_log_ratio_is_clamped_to_twenty() -> None:
    loss, metrics = loss_of([0.0], [50.0], [-1e-9], PolicyLossConfig(clip_ratio_c=1e12))
    assert loss == pytest.approx(1e-9 * math.exp(20.0), rel=1e-5)
    assert metrics["actor/ppo_kl"] == -20.0


def test_importance_weights_multiply_the_token_losses() -> None:
    loss, _ = loss_of([0.0, 0.0], [0.0, 0.0], [1.0, 2.0], rollout_is_weights=torch.tensor([[0.5, 0.25]]))
    assert loss == -1.0


def test_metrics_are_masked_means() -> None:
    old = torch.zeros(1, 4)
    new = torch.tensor([[math.log(1.5), 0.1, 0.0, 7.0]])
    loss, metrics = compute_policy_loss_per_rollout_mean(
        old, new, torch.ones(1, 4), torch.tensor([[1, 1, 1, 0]]), config=CONFIG
    )
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / 3, abs=1e-7)
    assert metrics["actor/ppo_kl"] == pytest.approx(-(math.log(1.5) + 0.1) / 3, abs=1e-7)
    assert loss.item() == pytest.approx(-(1.2 + math.exp(0.1) + 1.0), abs=1e-6)


def test_loss_agg_mode_is_ignored() -> None:
    args = (torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([[1.0, 3.0]]), torch.ones(1, 2))
    assert compute_policy_loss_per_rollout_mean(*args, "seq-mean-token-mean", CONFIG)[0].item() == -4.0


def test_a_missing_config_is_a_value_error_naming_config() -> None:
    with pytest.raises(ValueError, match="config is None"):
        compute_policy_loss_per_rollout_mean(
            torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)
        )


def test_clip_ratio_c_not_above_one_is_a_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"clip_ratio_c must be greater than 1.0, got 1.0"):
        loss_of([0.0], [0.0], [1.0], {"clip_ratio": 0.2, "clip_ratio_c": 1.0})


def test_padding_with_garbage_does_not_change_the_loss() -> None:
    old, new, adv = torch.tensor([[0.1, -0.2]]), torch.tensor([[0.3, 0.0]]), torch.tensor([[1.0, -2.0]])
    base, _ = compute_policy_loss_per_rollout_mean(old, new, adv, torch.ones(1, 2), config=CONFIG)
    pad = torch.tensor([[1e30, -1e30]])
    padded, _ = compute_policy_loss_per_rollout_mean(
        torch.cat((old, pad), 1),
        torch.cat((new, -pad), 1),
        torch.cat((adv, pad), 1),
        torch.tensor([[1, 1, 0, 0]]),
        config=CONFIG,
    )
    assert padded.item() == base.item()


@st.composite
def rollout_batches(draw: st.DrawFn) -> tuple[torch.Tensor, list[int], int]:
    """A mask over rows of several rollouts, each rollout with >= 1 trained token; returns mask, ids, R."""
    n_rollouts = draw(st.integers(1, 5))
    length = draw(st.integers(1, 6))
    ids: list[int] = []
    rows: list[list[int]] = []
    for r in range(n_rollouts):
        for k in range(draw(st.integers(1, 3))):
            row = draw(st.lists(st.integers(0, 1), min_size=length, max_size=length))
            if k == 0:
                row[0] = 1
            rows.append(row)
            ids.append(r)
    return torch.tensor(rows), ids, n_rollouts


@settings(max_examples=60, deadline=None)
@given(rollout_batches(), st.integers(1, 4))
def test_gradient_gives_every_rollout_the_same_total_weight(
    batch: tuple[torch.Tensor, list[int], int], dp_size: int
) -> None:
    mask, ids, n_rollouts = batch
    advantages = normalize_advantages_by_rollout(
        mask.float(), mask, ids, divisor="rows", num_trained_rows=len(ids)
    )
    log_prob = torch.zeros(mask.shape, requires_grad=True)
    loss, _ = compute_policy_loss_per_rollout_mean(
        torch.zeros(mask.shape), log_prob, advantages, mask, config=PolicyLossConfig(dp_size=dp_size)
    )
    loss.backward()
    assert log_prob.grad is not None
    per_rollout = torch.zeros(n_rollouts).index_add_(0, torch.tensor(ids), log_prob.grad.sum(-1))
    torch.testing.assert_close(per_rollout, torch.full((n_rollouts,), -dp_size / len(ids)))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_one_row_per_rollout_without_clipping_equals_the_policy_gradient_sum(data: st.DataObject) -> None:
    n, length = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 6))
    seed = data.draw(st.integers(0, 10_000))
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(n, length, generator=gen)
    new = old + torch.rand(n, length, generator=gen) * 2 - 1  # ratio in [e^-1, e], below clip_ratio_c=3
    mask = (torch.rand(n, length, generator=gen) > 0.3).long()
    raw = torch.randn(n, 1, generator=gen).expand(n, length) * mask
    advantages = normalize_advantages_by_rollout(
        raw, mask, list(range(n)), divisor="rows", num_trained_rows=n
    )
    no_clip = PolicyLossConfig(clip_ratio_low=1.0, clip_ratio_high=1e9)
    loss, metrics = compute_policy_loss_per_rollout_mean(old, new, advantages, mask, config=no_clip)
    plain = -(advantages * torch.exp(new - old) * mask).sum()
    torch.testing.assert_close(loss, plain)
    assert metrics["actor/pg_clipfrac"] == 0.0 and metrics["actor/pg_clipfrac_lower"] == 0.0


@settings(max_examples=80, deadline=None)
@given(
    st.floats(-3, 3),
    st.floats(-5, 5),
    st.floats(-2, 2),
    st.floats(0, 0.9),
    st.floats(0, 2),
    st.floats(1.01, 5),
)
def test_token_loss_matches_the_scalar_reference(
    old: float, new: float, adv: float, low: float, high: float, c: float
) -> None:
    config = PolicyLossConfig(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)
    loss, _ = loss_of([old], [new], [adv], config)
    assert loss == pytest.approx(ppo_token_loss(old, new, adv, low, high, c), rel=1e-4, abs=1e-4)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.floats(1.01, 4))
def test_dual_clip_only_ever_binds_for_negative_advantages(seed: int, c: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    old, new = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen) * 3
    advantages = torch.randn(4, 8, generator=gen)
    mask = torch.ones(4, 8)
    positive = advantages.clamp_min(0)
    with_dual, metrics = compute_policy_loss_per_rollout_mean(
        old, new, positive, mask, config=PolicyLossConfig(clip_ratio_c=c)
    )
    without, _ = compute_policy_loss_per_rollout_mean(
        old, new, positive, mask, config=PolicyLossConfig(clip_ratio_c=1e30)
    )
    assert metrics["actor/pg_clipfrac_lower"] == 0.0
    assert with_dual.item() == without.item()
    _, mixed = compute_policy_loss_per_rollout_mean(
        old, new, advantages, mask, config=PolicyLossConfig(clip_ratio_c=c)
    )
    binds = (-advantages * torch.exp(new - old).clamp(0.8, 1.2)).maximum(
        -advantages * torch.exp(new - old)
    ) > -advantages * c
    assert mixed["actor/pg_clipfrac_lower"] == pytest.approx(
        ((advantages < 0) & binds).float().mean().item(), abs=1e-6
    )


def test_rollouts_divisor_gives_every_rollout_mass_one_over_rollouts() -> None:
    # rollout A: rows of 2 and 1 tokens (3 in all), B: one row of 3; 2 rollouts -> 1 / (3 x 2) everywhere,
    # where the rows divisor gives 1 / (3 x 3): A's second row costs both rollouts a third of their weight
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    out = normalize_advantages_by_rollout(torch.ones(3, 3), mask, ["A", "A", "B"], divisor="rollouts")
    assert torch.equal(out, torch.full((3, 3), 1 / 6))
    masses = [(out[:2] * mask[:2]).sum().item(), (out[2] * mask[2]).sum().item()]
    assert masses == pytest.approx([1 / 2, 1 / 2], abs=1e-7)


def test_rollouts_divisor_takes_an_explicit_step_count_over_the_ids_given() -> None:
    # the call holds one rollout of 4 tokens out of a step of 5 rollouts: 8 / (4 x 5) = 0.4
    out = normalize_advantages_by_rollout(
        torch.full((1, 4), 8.0), torch.ones(1, 4), ["x"], divisor="rollouts", num_trained_rollouts=5
    )
    assert torch.equal(out, torch.full((1, 4), 0.4))


def test_rollouts_divisor_ignores_num_trained_rows_and_counts_codes() -> None:
    mask = torch.tensor([[1, 1], [1, 0], [0, 1]])
    codes = torch.tensor([0, 1, 1])
    # a: 2 tokens, b: 2 tokens over two rows; 2 rollouts -> 1 / 4
    out = normalize_advantages_by_rollout(
        torch.ones(3, 2), mask, ["a", "b", "b"], divisor="rollouts", num_trained_rows=99, rollout_codes=codes
    )
    assert torch.equal(out, torch.full((3, 2), 0.25))


def test_an_unknown_divisor_is_refused_with_the_supported_ones() -> None:
    with pytest.raises(
        ValueError, match=r"Unsupported per_rollout_divisor: 'tokens'. Supported: \['rollouts', 'rows'\]"
    ):
        normalize_advantages_by_rollout(torch.ones(1, 1), torch.ones(1, 1), ["a"], divisor="tokens")  # type: ignore[arg-type]


def test_rows_divisor_without_num_trained_rows_names_it() -> None:
    with pytest.raises(ValueError, match=r"divisor='rows' needs num_trained_rows"):
        normalize_advantages_by_rollout(torch.ones(1, 1), torch.ones(1, 1), ["a"], divisor="rows")


def test_non_positive_num_trained_rollouts_is_refused() -> None:
    with pytest.raises(ValueError, match="num_trained_rollouts must be positive, got 0"):
        normalize_advantages_by_rollout(
            torch.ones(1, 1), torch.ones(1, 1), ["a"], divisor="rollouts", num_trained_rollouts=0
        )


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_rollouts_divisor_matches_the_loop_with_the_distinct_rollout_count(data: st.DataObject) -> None:
    n_rows, length = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 6))
    ids = data.draw(st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=n_rows, max_size=n_rows))
    mask = torch.tensor(
        data.draw(st.lists(st.integers(0, 1), min_size=n_rows * length, max_size=n_rows * length))
    ).reshape(n_rows, length)
    advantages = torch.randn(
        n_rows, length, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    )
    out = normalize_advantages_by_rollout(advantages, mask, ids, divisor="rollouts")
    torch.testing.assert_close(out, normalize_by_rollout_loop(advantages, mask, ids, len(set(ids))))


def test_rollout_token_totals_give_each_row_its_rollouts_total() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
    # A: 2 + 1 = 3 tokens; B: 3; C: 0
    assert rollout_token_totals(mask, ["A", "A", "B", "C"]).tolist() == [3, 3, 3, 0]


def test_rows_per_rollout_mean_is_rows_over_distinct_rollouts() -> None:
    # 5 rows over 2 rollouts
    assert rows_per_rollout_metrics(["a", "a", "b", "a", "b"]) == {"training/rows_per_rollout_mean": 2.5}
    assert rows_per_rollout_metrics([]) == {"training/rows_per_rollout_mean": 0.0}


@pytest.mark.parametrize("divisor", ["rollouts", "rows"])
def test_normalization_passes_gradcheck_in_float64(divisor: RolloutDivisor) -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    advantages = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)

    def normalized(adv: torch.Tensor) -> torch.Tensor:
        return normalize_advantages_by_rollout(
            adv, mask, ["A", "A", "B"], divisor=divisor, num_trained_rows=3
        )

    assert torch.autograd.gradcheck(normalized, (advantages,))
