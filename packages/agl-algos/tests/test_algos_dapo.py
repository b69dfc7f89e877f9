"""DAPO's overlong reward shaping and dynamic-sampling group filter, on rollout-level rewards."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from algos_reference import overlong_penalty_loop, zero_variance_filter_loop
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_algos import (
    OverlongBuffer,
    filter_zero_variance_groups,
    overlong_reward_penalty,
    rollout_token_totals,
)

BUFFER = OverlongBuffer(buffer_len=20, penalty_factor=1.0, max_response_length=100)


def test_overlong_penalty_is_linear_over_the_buffer_and_not_floored() -> None:
    # expected length 100 - 20 = 80: 10 and 80 tokens -> 0; 90 -> -(10 / 20) = -0.5; 100 -> -1;
    # 120 (a multi-row rollout past max_response_length) -> -(40 / 20) = -2
    lengths = torch.tensor([10, 80, 90, 100, 120])
    assert overlong_reward_penalty(lengths, BUFFER).tolist() == [0.0, 0.0, -0.5, -1.0, -2.0]


def test_overlong_penalty_factor_scales_it() -> None:
    # 95 tokens, buffer 10 of max 100: -(95 - 90) / 10 * 0.4 = -0.2
    buffer = OverlongBuffer(buffer_len=10, penalty_factor=0.4, max_response_length=100)
    assert overlong_reward_penalty(torch.tensor([95]), buffer).tolist() == pytest.approx([-0.2])


def test_overlong_penalty_of_a_multi_row_rollout_counts_all_its_rows() -> None:
    # rollout a: 50 + 40 = 90 trained tokens over two rows -> -0.5 on both rows; b: 60 -> 0
    mask = (torch.arange(60) < torch.tensor([[50], [40], [60]])).long()
    penalty = overlong_reward_penalty(rollout_token_totals(mask, ["a", "a", "b"]), BUFFER)
    assert penalty.tolist() == [-0.5, -0.5, 0.0]


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 400), st.integers(1, 100), st.floats(0, 3), st.integers(0, 200))
def test_overlong_penalty_matches_verls_formula(
    length: int, buffer_len: int, factor: float, extra: int
) -> None:
    buffer = OverlongBuffer(
        buffer_len=buffer_len, penalty_factor=factor, max_response_length=buffer_len + extra
    )
    ours = overlong_reward_penalty(torch.tensor([length]), buffer).item()
    assert ours == pytest.approx(
        overlong_penalty_loop(length, buffer_len, factor, buffer_len + extra), rel=1e-6
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"buffer_len": 0}, "overlong_buffer.len must be a positive integer, got 0"),
        ({"buffer_len": 2.5}, "overlong_buffer.len must be a positive integer, got 2.5"),
        (
            {"max_response_length": 10},
            r"max_response_length \(10\) must be an integer >= overlong_buffer.len \(20\)",
        ),
        ({"penalty_factor": -1.0}, "penalty_factor must be a finite number >= 0, got -1.0"),
        ({"penalty_factor": float("nan")}, "penalty_factor must be a finite number >= 0, got nan"),
    ],
)
def test_invalid_overlong_buffer_names_the_key(kwargs: dict[str, object], match: str) -> None:
    values: dict[str, object] = {
        "buffer_len": 20,
        "penalty_factor": 1.0,
        "max_response_length": 100,
        **kwargs,
    }
    with pytest.raises(ValueError, match=match):
        OverlongBuffer(**values)  # type: ignore[arg-type]


def test_overlong_buffer_from_verls_config_keys() -> None:
    buffer = OverlongBuffer.from_config({"enable": True, "len": 512, "penalty_factor": 1.0}, 4096)
    assert buffer == OverlongBuffer(buffer_len=512, penalty_factor=1.0, max_response_length=4096)
    with pytest.raises(ValueError, match="overlong_buffer needs len and penalty_factor"):
        OverlongBuffer.from_config({"len": 512}, 4096)


def test_filter_keeps_groups_with_different_rewards_and_singletons() -> None:
    # g: 1, 0 (kept); h: 1, 1 (filtered); s: one rollout (kept); z: seven 0.7 (filtered)
    rewards = [1.0, 0.0, 1.0, 1.0, 0.5, *[0.7] * 7]
    groups = ["g", "g", "h", "h", "s", *["z"] * 7]
    result = filter_zero_variance_groups(rewards, groups)
    assert result.kept.tolist() == [0, 1, 4]
    assert result.metrics() == {
        "training/dynamic_sampling/groups_kept": 2,
        "training/dynamic_sampling/groups_filtered": 2,
    }


def test_seven_rewards_of_0_7_are_filtered_where_verls_std_test_keeps_them() -> None:
    rewards = np.full(7, 0.7)
    assert float(np.std(rewards)) != 0.0  # verl's DAPO criterion: std 1.1e-16, so the group is kept
    assert filter_zero_variance_groups(rewards, ["z"] * 7).n_groups_filtered == 1


def test_with_rollout_ids_a_group_counts_rollouts_not_rows() -> None:
    # group g holds one rollout over two rows (kept as a singleton); counted as rows it would be two
    # equal rewards and filtered
    rewards, groups = torch.tensor([1.0, 1.0]), ["g", "g"]
    assert filter_zero_variance_groups(rewards, groups, rollout_ids=["r", "r"]).kept.tolist() == [0, 1]
    assert filter_zero_variance_groups(rewards, groups).kept.tolist() == []


def test_filter_refuses_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match=r"rewards must have shape \(2,\)"):
        filter_zero_variance_groups([1.0], ["a", "b"])
    with pytest.raises(ValueError, match=r"rollout_ids must have one entry per reward \(2\), got 1"):
        filter_zero_variance_groups([1.0, 0.0], ["a", "b"], rollout_ids=["r"])


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_filter_matches_the_loop_reference(data: st.DataObject) -> None:
    n_rollouts = data.draw(st.integers(0, 12))
    groups_of = data.draw(st.lists(st.sampled_from("pqrs"), min_size=n_rollouts, max_size=n_rollouts))
    rewards_of = data.draw(
        st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=n_rollouts, max_size=n_rollouts)
    )
    rows = [r for r in range(n_rollouts) for _ in range(data.draw(st.integers(1, 3)))]
    rewards, groups = [rewards_of[r] for r in rows], [groups_of[r] for r in rows]
    result = filter_zero_variance_groups(rewards, groups, rollout_ids=rows)
    assert result.kept.tolist() == zero_variance_filter_loop(rewards, groups, rows)
    assert result.n_groups_kept + result.n_groups_filtered == len(set(groups))
