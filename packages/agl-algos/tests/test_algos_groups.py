"""Zero-advantage selection, the mini-batch cut and GRPO group metrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_algos import (
    grpo_group_metrics,
    mini_batch_keep_count,
    row_rewards_from_scores,
    same_reward_group_rows,
    select_rows_to_keep,
    zero_advantage_drop_order,
)

UIDS = ["a", "a", "b", "b", "c", "d", "d"]
REWARDS = [1.0, 1.0, 0.0, 1.0, 0.5, 0.3, 0.3 + 1e-9]  # a, c (single row) and d (all-close) have equal rewards


def test_same_reward_group_rows_lists_every_row_of_equal_reward_groups() -> None:
    assert same_reward_group_rows(UIDS, REWARDS).tolist() == [0, 1, 4, 5, 6]


def test_same_reward_group_rows_accepts_tensors_and_numpy() -> None:
    rows = same_reward_group_rows(np.array(UIDS, dtype=object), torch.tensor(REWARDS))
    assert rows.tolist() == [0, 1, 4, 5, 6]


def test_cut_drops_same_reward_rows_first_and_keeps_order() -> None:
    selection = select_rows_to_keep(UIDS, REWARDS, 4, np.random.default_rng(0))
    assert selection.keep.tolist() == sorted(selection.keep.tolist())
    assert {2, 3} <= set(selection.keep.tolist())
    assert selection.metrics() == {
        "training/n_sample_dropped/same_reward": 3,
        "training/n_sample_dropped/random": 0,
        "training/n_sample_trained": 4,
    }


def test_cut_drops_randomly_once_same_reward_rows_are_gone() -> None:
    selection = select_rows_to_keep(UIDS, REWARDS, 1, torch.Generator().manual_seed(3))
    assert selection.keep.shape == (1,) and selection.keep[0] in (2, 3)
    assert selection.metrics()["training/n_sample_dropped/same_reward"] == 5
    assert selection.metrics()["training/n_sample_dropped/random"] == 1


def test_cut_to_at_least_the_batch_keeps_everything() -> None:
    selection = select_rows_to_keep(UIDS, REWARDS, 10, np.random.default_rng(0))
    assert selection.keep.tolist() == list(range(7))
    assert selection.metrics()["training/n_sample_trained"] == 7


def test_cut_is_reproducible_with_a_seeded_generator() -> None:
    first = select_rows_to_keep(UIDS, REWARDS, 5, np.random.default_rng(42)).keep
    second = select_rows_to_keep(UIDS, REWARDS, 5, np.random.default_rng(42)).keep
    assert first.tolist() == second.tolist()


def test_negative_n_keep_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="n_keep must be >= 0"):
        select_rows_to_keep(UIDS, REWARDS, -1, np.random.default_rng(0))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_drop_order_puts_every_same_reward_row_before_any_other(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 20))
    uids = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    rewards = data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n))
    order = zero_advantage_drop_order(uids, rewards, np.random.default_rng(data.draw(st.integers(0, 99))))
    candidates = set(same_reward_group_rows(uids, rewards).tolist())
    assert sorted(order.tolist()) == list(range(n))
    assert set(order[: len(candidates)].tolist()) == candidates


@pytest.mark.parametrize(
    ("n_rows", "mini", "cap", "expected"),
    [(70, 16, None, 64), (15, 16, None, 0), (64, 16, None, 64), (70, 16, 2, 32), (70, 16, 10, 64)],
)
def test_mini_batch_keep_count_floors_and_caps(
    n_rows: int, mini: int, cap: int | None, expected: int
) -> None:
    assert mini_batch_keep_count(n_rows, mini, max_ppo_update_times=cap) == expected


def test_mini_batch_keep_count_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="mini_batch_rows must be positive"):
        mini_batch_keep_count(10, 0)
    with pytest.raises(ValueError, match="max_ppo_update_times must be positive"):
        mini_batch_keep_count(10, 2, max_ppo_update_times=0)


def test_grpo_group_metrics_counts_groups_with_exactly_equal_rewards() -> None:
    # d differs by 1e-9 in float64 but not in float32; the count is exact on the float32 rewards
    assert grpo_group_metrics(UIDS, REWARDS) == {"training/n_groups": 4, "training/n_zero_adv_groups": 3}
    assert grpo_group_metrics(["x", "x"], [0.25, 0.5]) == {
        "training/n_groups": 1,
        "training/n_zero_adv_groups": 0,
    }
    assert grpo_group_metrics([], []) == {"training/n_groups": 0, "training/n_zero_adv_groups": 0}


def test_row_rewards_from_scores_sums_in_float32() -> None:
    scores = torch.tensor([[0.0, 0.1, 0.2], [1.0, 0.0, 0.0]], dtype=torch.bfloat16)
    rewards = row_rewards_from_scores(scores)
    assert rewards.dtype == torch.float32
    # bf16 holds 0.1 as 0.10009765625 and 0.2 as 0.2001953125; a bf16 sum would round to 0.30078125
    assert rewards.tolist() == [0.30029296875, 1.0]


def test_rewards_of_the_wrong_length_are_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"row_rewards must have shape \(2,\)"):
        grpo_group_metrics(["a", "b"], [1.0])
