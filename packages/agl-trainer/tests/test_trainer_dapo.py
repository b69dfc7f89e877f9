"""DAPO in the trainer: overlong reward shaping on a batch, dynamic sampling over generation batches."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch
from verl import DataProto

from agl_rollout import CarriedGroup, CollectedGroups
from agl_trainer.assembly import compose_config
from agl_trainer.settings import DynamicSamplingSettings, OverlongSettings, parse_settings
from agl_trainer.step.dynamic_sampling import dynamic_sampling_metrics, keeps_group, max_groups_examined
from agl_trainer.step.overlong import shape_overlong
from agl_types import CompletedRollout, RolloutState

pytestmark = pytest.mark.verl

_OVERLONG = "+reward.reward_kwargs.overlong_buffer_cfg"


def _overlong(*overrides: str) -> OverlongSettings | None:
    max_response_length = "agentlightning.trace_aggregator.trajectory_max_response_length=8"
    return parse_settings(compose_config([max_response_length, *overrides])).overlong


def test_overlong_shaping_is_off_unless_enabled() -> None:
    assert _overlong() is None
    assert (
        _overlong(f"{_OVERLONG}.enable=false", f"{_OVERLONG}.len=4", f"{_OVERLONG}.penalty_factor=1.0")
        is None
    )


def test_overlong_penalty_is_added_to_every_row_of_a_long_rollout_on_its_last_response_token() -> None:
    shaping = _overlong(f"{_OVERLONG}.enable=true", f"{_OVERLONG}.len=4", f"{_OVERLONG}.penalty_factor=2.0")
    assert shaping is not None
    # responses 8 wide; rollout a: rows of 3 + 3 trained tokens (6 of max 8, buffer 4 -> 2 over 4:
    # penalty -2/4*2 = -1.0), rollout b: one row of 4 tokens (not over 8 - 4: no penalty)
    response_mask = torch.zeros(3, 8, dtype=torch.int64)
    response_mask[0, :3] = response_mask[1, :3] = response_mask[2, :4] = 1
    attention = torch.cat([torch.ones(3, 2, dtype=torch.int64), response_mask], dim=1)
    scores = torch.zeros(3, 8)
    scores[0, 2], scores[1, 2], scores[2, 3] = 1.0, 1.0, 0.5
    batch = DataProto.from_dict(
        tensors={"response_mask": response_mask, "attention_mask": attention, "token_level_scores": scores},
        non_tensors={"rollout_id_list": np.array(["a", "a", "b"], dtype=object)},
    )
    batch, metrics = shape_overlong(batch, shaping)
    expected = torch.zeros(3, 8)
    expected[0, 2], expected[1, 2], expected[2, 3] = 0.0, 0.0, 0.5
    torch.testing.assert_close(batch.batch["token_level_scores"], expected)
    assert metrics == {
        "training/overlong/penalty_mean": pytest.approx(-2 / 3),
        "training/overlong/rows_penalized": 2,
    }


def test_overlong_max_length_is_verls_max_resp_len_when_given() -> None:
    shaping = _overlong(
        f"{_OVERLONG}.enable=true",
        f"{_OVERLONG}.len=4",
        f"{_OVERLONG}.penalty_factor=1.0",
        "+reward.reward_kwargs.max_resp_len=16",
    )
    assert shaping is not None and shaping.buffer.max_response_length == 16


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [f"{_OVERLONG}.enable=true", f"{_OVERLONG}.len=0", f"{_OVERLONG}.penalty_factor=1.0"],
            "overlong_buffer.len must be",
        ),
        ([f"{_OVERLONG}.enable=true", f"{_OVERLONG}.len=4"], "overlong_buffer needs len and penalty_factor"),
        (
            ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"],
            "algorithm.filter_groups.metric='acc'",
        ),
    ],
)
def test_a_bad_dapo_key_fails_at_start_naming_it(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_settings(compose_config(overrides))


def _rollout(data_id: str, reward: float | None, n: int) -> CompletedRollout:
    return CompletedRollout(
        rollout_id=f"{data_id}-{n}",
        data_id=data_id,
        step=1,
        sample_idx_in_step=0,
        enqueue_time=0.0,
        final_reward=reward,
        rollout_state=RolloutState.SUCCEEDED,
    )


def _group(data_id: str, *rewards: float | None) -> CarriedGroup:
    return CarriedGroup(
        data_id=data_id,
        first_step=1,
        completed=[_rollout(data_id, reward, n) for n, reward in enumerate(rewards)],
    )


def _sampling(max_num_gen_batches: int = 0) -> DynamicSamplingSettings:
    return DynamicSamplingSettings(max_num_gen_batches, reward_fillna_value=0.0)


def test_dynamic_sampling_is_off_unless_filter_groups_is_enabled() -> None:
    assert parse_settings(compose_config()).pipeline.dynamic_sampling is None
    keys = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=3"]
    config = compose_config([*keys, "agentlightning.reward_fillna_value=0.5"])
    assert parse_settings(config).pipeline.dynamic_sampling == DynamicSamplingSettings(3, 0.5)


def test_dynamic_sampling_keeps_groups_whose_rewards_differ() -> None:
    sampling = _sampling()
    assert keeps_group(_group("b", 0, 1), sampling)
    assert not keeps_group(_group("a", 1, 1), sampling)
    assert not keeps_group(_group("c", 0, None), sampling)  # the missing reward is reward_fillna_value, 0.0
    assert keeps_group(_group("c", 0, None), DynamicSamplingSettings(0, reward_fillna_value=1.0))


def test_dynamic_sampling_keeps_a_group_of_one_rollout() -> None:
    assert keeps_group(_group("a", 1.0), _sampling())


def test_dynamic_sampling_looks_at_max_num_gen_batches_generation_batches_at_most() -> None:
    assert max_groups_examined(_sampling(3), gen_batch_size=4) == 12
    assert max_groups_examined(_sampling(0), gen_batch_size=4) is None


def test_dynamic_sampling_counts_generation_batches_and_says_when_a_step_is_short(
    caplog: pytest.LogCaptureFixture,
) -> None:
    collected = CollectedGroups([_group("b", 0, 1)], n_examined=5, n_filtered=4, short=True)
    with caplog.at_level(logging.WARNING, logger="agl_trainer"):
        metrics = dynamic_sampling_metrics(
            collected, _sampling(2), gen_batch_size=4, train_batch_size=2, step=7
        )
    assert metrics == {
        "training/dynamic_sampling/groups_kept": 1.0,
        "training/dynamic_sampling/groups_filtered": 4.0,
        "training/dynamic_sampling/gen_batches": 2.0,
    }
    assert "step 7: dynamic sampling kept 1 of 2 groups after 2 generation batches" in caplog.text
