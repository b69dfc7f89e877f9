"""PolicyLossConfig: reading verl-style configs and rejecting invalid values with the key named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from agl_algos import PolicyLossConfig


def test_low_and_high_fall_back_to_clip_ratio() -> None:
    config = PolicyLossConfig(clip_ratio=0.3, clip_ratio_high=0.28)
    assert (config.low, config.high) == (0.3, 0.28)


def test_reads_a_mapping_with_global_batch_info() -> None:
    config = PolicyLossConfig.from_actor_config(
        {"clip_ratio": 0.1, "clip_ratio_low": 0.05, "clip_ratio_c": 10.0, "global_batch_info": {"dp_size": 8}}
    )
    assert config == PolicyLossConfig(clip_ratio=0.1, clip_ratio_low=0.05, clip_ratio_c=10.0, dp_size=8)


def test_reads_attributes_and_defaults_an_empty_global_batch_info_to_one() -> None:
    actor = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=0.3, global_batch_info={})
    assert PolicyLossConfig.from_actor_config(actor) == PolicyLossConfig(clip_ratio_high=0.3, dp_size=1)


@pytest.mark.parametrize("dp_size", [0, None])
def test_dp_size_zero_or_none_means_one(dp_size: int | None) -> None:
    assert PolicyLossConfig.from_actor_config({"global_batch_info": {"dp_size": dp_size}}).dp_size == 1


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"clip_ratio_c": 0.5}, "clip_ratio_c"),
        ({"clip_ratio_low": -0.1}, "clip_ratio_low"),
        ({"clip_ratio_high": float("nan")}, "clip_ratio_high"),
        ({"clip_ratio": "0.2"}, "clip_ratio"),
        ({"dp_size": 0}, "dp_size"),
        ({"clip_ratio": None}, "clip_ratio"),
    ],
)
def test_invalid_values_are_value_errors_naming_the_key(kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        PolicyLossConfig(**kwargs)  # type: ignore[arg-type]


def test_clip_ratio_may_be_none_when_low_and_high_are_both_set() -> None:
    assert PolicyLossConfig(clip_ratio=None, clip_ratio_low=0.1, clip_ratio_high=0.2).low == 0.1
