"""Rollout-level GRPO advantage: hand-computed values, errors, and properties against a naive loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from algos_reference import grpo_loop, rollout_level_loop
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_algos import (
    RolloutConsistencyError,
    broadcast_rollout_scalars,
    compute_rollout_level_advantage,
    extract_rollout_scalars,
    grpo_outcome_advantage,
    rollout_layout,
)


def rewards_on_last_token(row_rewards: list[float], mask: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(mask.shape)
    for row, reward in enumerate(row_rewards):
        last = int(mask[row].nonzero().max()) if mask[row].any() else mask.shape[1] - 1
        out[row, last] = reward
    return out


def test_grpo_over_one_row_per_rollout_gives_plus_minus_0_866() -> None:
    # rewards {1,0,0,1}: mean 0.5, unbiased std sqrt(1/3) = 0.57735027; 0.5 / (0.57735027 + 1e-6) = 0.8660239
    mask = torch.ones(4, 3)
    result = compute_rollout_level_advantage(
        rewards_on_last_token([1, 0, 0, 1], mask), mask, ["a", "b", "c", "d"], ["g"] * 4
    )
    expected = torch.tensor([0.8660239, -0.8660239, -0.8660239, 0.8660239]).unsqueeze(-1)
    torch.testing.assert_close(result.advantages, expected.expand(4, 3), rtol=0, atol=1e-7)


def test_multi_row_rollout_counts_once_in_its_group_and_shares_its_value() -> None:
    # rollout "a" has two rows (reward 1 on each), "b" and "c" one row each: group rewards {1, 0, 0}.
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
    rewards = rewards_on_last_token([1, 1, 0, 0], mask)
    result = compute_rollout_level_advantage(rewards, mask, ["a", "a", "b", "c"], ["g"] * 4)
    # mean 1/3, unbiased std sqrt(1/3): a -> (2/3) / (0.57735027 + 1e-6), b, c -> (-1/3) / (0.57735027 + 1e-6)
    a, other = 1.1546985, -0.5773493
    expected = torch.tensor([[a, a, 0], [a, 0, 0], [other, other, other], [other, 0, 0]])
    torch.testing.assert_close(result.advantages, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(result.returns, expected, rtol=0, atol=1e-6)
    assert (result.n_rows, result.n_rollouts, result.n_multi_row_rollouts) == (4, 3, 1)
    assert result.metrics() == {
        "training/rollout_level_advantage/n_rows": 4,
        "training/rollout_level_advantage/n_rollouts": 3,
        "training/rollout_level_advantage/n_multi_row_rollouts": 1,
        "training/rollout_level_advantage/max_rows_per_rollout": 2,
    }


def test_group_of_one_uses_mean_zero_and_std_one() -> None:
    scores = torch.tensor([0.5, 2.0, 4.0])
    normed = grpo_outcome_advantage(scores, ["x", "y", "y"])
    assert normed[0].item() == pytest.approx(0.4999995, abs=1e-7)
    raw = grpo_outcome_advantage(scores, ["x", "y", "y"], norm_adv_by_std_in_grpo=False)
    assert raw.tolist() == [0.5, -1.0, 1.0]


def test_dr_grpo_subtracts_the_mean_only() -> None:
    mask = torch.ones(3, 2)
    result = compute_rollout_level_advantage(
        rewards_on_last_token([3, 0, 0], mask), mask, [1, 2, 3], [7, 7, 7], norm_adv_by_std_in_grpo=False
    )
    assert result.advantages[:, 0].tolist() == [2.0, -1.0, -1.0]


def test_advantages_are_float32_even_from_bfloat16_rewards() -> None:
    mask = torch.ones(2, 2, dtype=torch.bool)
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=torch.bfloat16)
    result = compute_rollout_level_advantage(rewards, mask, ["a", "b"], ["g", "g"])
    assert result.advantages.dtype == torch.float32
    assert result.returns.dtype == torch.float32


def test_inputs_are_not_modified() -> None:
    mask = torch.tensor([[1, 1], [1, 0]])
    rewards = rewards_on_last_token([1, 0], mask)
    rewards_before, mask_before = rewards.clone(), mask.clone()
    ids = np.array(["a", "b"], dtype=object)
    compute_rollout_level_advantage(rewards, mask, ids, ["g", "g"])
    assert torch.equal(rewards, rewards_before) and torch.equal(mask, mask_before)
    assert ids.tolist() == ["a", "b"]


def test_rows_of_one_rollout_with_two_uids_raise_naming_rollout_and_rows() -> None:
    mask = torch.ones(3, 2)
    with pytest.raises(RolloutConsistencyError, match=r"rollout_id='r1': rows \[0, 2\] carry several uid"):
        compute_rollout_level_advantage(torch.zeros(3, 2), mask, ["r1", "r2", "r1"], ["g1", "g1", "g2"])


def test_rows_of_one_rollout_with_two_rewards_raise_naming_rollout_and_rows() -> None:
    mask = torch.ones(3, 2)
    rewards = rewards_on_last_token([1.0, 0.0, 0.5], mask)
    with pytest.raises(
        RolloutConsistencyError, match=r"rollout_id='r1': rows \[0, 2\] have reward sums \[1.0, 0.5\]"
    ):
        compute_rollout_level_advantage(rewards, mask, ["r1", "r2", "r1"], ["g", "g", "g"])


def test_shape_mismatch_between_rewards_and_mask_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="response_mask"):
        compute_rollout_level_advantage(torch.zeros(2, 3), torch.ones(2, 2), ["a", "b"], ["g", "g"])


def test_ids_count_must_match_rows() -> None:
    with pytest.raises(ValueError, match="one entry per row"):
        compute_rollout_level_advantage(torch.zeros(2, 3), torch.ones(2, 3), ["a"], ["g", "g"])


def test_extract_rollout_scalars_reads_the_constant_value() -> None:
    values = torch.tensor([[0.0, 2.5, 2.5], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]])
    assert extract_rollout_scalars(values, mask, ["a", "b"]).tolist() == [2.5, -1.0]


def test_extract_rollout_scalars_rejects_token_varying_values() -> None:
    values = torch.tensor([[1.0, 2.0]])
    with pytest.raises(RolloutConsistencyError, match=r"rollout_id='gae'.*outcome estimator"):
        extract_rollout_scalars(values, torch.ones(1, 2), ["gae"])


def test_extract_rollout_scalars_rejects_a_row_without_trained_tokens() -> None:
    with pytest.raises(RolloutConsistencyError, match=r"rollout_id='e' has no trained token"):
        extract_rollout_scalars(torch.zeros(1, 2), torch.zeros(1, 2), ["e"])


def test_rollout_layout_numbers_rollouts_by_first_appearance() -> None:
    layout = rollout_layout(
        ["r2", "r1", "r2", "r3", "r1"], ["g"] * 5, torch.tensor([1.0, 0.0, 1.0, 0.5, 0.0])
    )
    assert layout.rollout_of_row.tolist() == [0, 1, 0, 2, 1]
    assert layout.representatives.tolist() == [0, 1, 3]
    assert layout.rollout_ids.tolist() == ["r2", "r1", "r3"]
    assert layout.rows_per_rollout.tolist() == [2, 2, 1]
    assert layout.metrics() == {
        "training/rollout_level_advantage/n_rows": 5,
        "training/rollout_level_advantage/n_rollouts": 3,
        "training/rollout_level_advantage/n_multi_row_rollouts": 2,
        "training/rollout_level_advantage/max_rows_per_rollout": 2,
    }


def test_rollout_layout_of_no_rows_is_empty_with_zero_metrics() -> None:
    layout = rollout_layout([], [], torch.zeros(0))
    assert layout.rollout_of_row.tolist() == [] and layout.representatives.tolist() == []
    assert layout.metrics()["training/rollout_level_advantage/max_rows_per_rollout"] == 0


def test_broadcast_rollout_scalars_puts_each_rollout_value_on_its_trained_tokens() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 0]], dtype=torch.bool)
    out = broadcast_rollout_scalars(torch.tensor([2.5, -1.0]), np.array([1, 0, 1]), mask)
    assert out.dtype == torch.float32
    assert out.tolist() == [[-1.0, -1.0, 0.0], [0.0, 2.5, 2.5], [-1.0, 0.0, 0.0]]


def test_broadcast_rollout_scalars_casts_float64_scalars_to_float32() -> None:
    out = broadcast_rollout_scalars(
        torch.tensor([0.1], dtype=torch.float64), np.array([0, 0]), torch.ones(2, 1)
    )
    assert out.dtype == torch.float32 and out.flatten().tolist() == [0.10000000149011612] * 2


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, list[str], list[str]]:
    n_groups = draw(st.integers(1, 4))
    rollouts: list[tuple[str, str, float, int]] = []
    for g in range(n_groups):
        for r in range(draw(st.integers(1, 4))):
            reward = draw(st.sampled_from([0.0, 1.0, 0.5, -2.0, 0.7]))
            rollouts.append((f"g{g}r{r}", f"g{g}", reward, draw(st.integers(1, 3))))
    length = draw(st.integers(1, 5))
    rows = [(rid, uid, reward) for rid, uid, reward, n_rows in rollouts for _ in range(n_rows)]
    order = draw(st.permutations(range(len(rows))))
    rows = [rows[i] for i in order]
    mask = torch.tensor([draw(st.lists(st.integers(0, 1), min_size=length, max_size=length)) for _ in rows])
    rewards = torch.zeros(mask.shape)
    rewards[:, -1] = torch.tensor([reward for _, _, reward in rows])
    return rewards, mask, [r[0] for r in rows], [r[1] for r in rows]


@settings(max_examples=60, deadline=None)
@given(batches(), st.booleans())
def test_matches_the_naive_loop(
    batch: tuple[torch.Tensor, torch.Tensor, list[str], list[str]], norm: bool
) -> None:
    rewards, mask, rollout_ids, uids = batch
    result = compute_rollout_level_advantage(rewards, mask, rollout_ids, uids, norm_adv_by_std_in_grpo=norm)
    expected = rollout_level_loop(rewards, mask, rollout_ids, uids, norm)
    torch.testing.assert_close(result.advantages, expected, rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(batches())
def test_broadcast_gives_a_rollout_one_value_and_untrained_tokens_zero(
    batch: tuple[torch.Tensor, torch.Tensor, list[str], list[str]],
) -> None:
    rewards, mask, rollout_ids, uids = batch
    advantages = compute_rollout_level_advantage(rewards, mask, rollout_ids, uids).advantages
    assert torch.all(advantages[mask == 0] == 0)
    for rid in set(rollout_ids):
        rows = [i for i, r in enumerate(rollout_ids) if r == rid]
        trained = advantages[rows][mask[rows] == 1]
        assert trained.numel() == 0 or torch.all(trained == trained[0])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 8), st.floats(-10, 10, width=32)), min_size=1, max_size=6),
    st.booleans(),
)
def test_equal_reward_groups_get_exactly_zero_advantage(groups: list[tuple[int, float]], norm: bool) -> None:
    scores = [reward for size, reward in groups for _ in range(size)]
    ids = [g for g, (size, _) in enumerate(groups) for _ in range(size)]
    advantage = grpo_outcome_advantage(torch.tensor(scores), ids, norm_adv_by_std_in_grpo=norm)
    for g, (size, reward) in enumerate(groups):
        members = advantage[torch.tensor(ids) == g]
        if size > 1:
            assert torch.all(members == 0)
        else:
            expected = reward / (1 + 1e-6) if norm else reward
            assert members.item() == pytest.approx(expected, rel=1e-6, abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-5, 5, width=32), min_size=2, max_size=8),
    st.floats(-100, 100, width=32),
)
def test_shifting_all_rewards_of_a_group_leaves_advantages_unchanged(
    scores: list[float], shift: float
) -> None:
    ids = ["g"] * len(scores)
    base = grpo_outcome_advantage(torch.tensor(scores, dtype=torch.float64), ids)
    shifted = grpo_outcome_advantage(torch.tensor(scores, dtype=torch.float64) + shift, ids)
    torch.testing.assert_close(shifted, base, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(
        base, torch.tensor(grpo_loop(scores, ids), dtype=torch.float32), rtol=1e-5, atol=1e-5
    )


def test_unhashable_ids_are_a_value_error_naming_the_field() -> None:
    ids = np.empty(2, dtype=object)
    ids[0], ids[1] = [1], [2]
    with pytest.raises(ValueError, match="rollout_ids must hold hashable ids"):
        rollout_layout(ids, ["g"] * 2, torch.zeros(2))
