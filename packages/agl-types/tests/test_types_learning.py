"""Validation and helpers of the learning-side models."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from agl_types import CompletedRollout, EnqueuedRollout, RolloutState, Triplet


def _completed(**overrides: object) -> CompletedRollout:
    fields: dict[str, object] = {
        "rollout_id": "r1",
        "data_id": "d1",
        "step": 3,
        "sample_idx_in_step": 1,
        "enqueue_time": 10.0,
        "rollout_state": RolloutState.SUCCEEDED,
        "final_reward": 1.0,
        "triplets": [Triplet(prompt_token_ids=[1, 2], response_token_ids=[3], response_log_probs=[-0.5])],
    }
    fields.update(overrides)
    return CompletedRollout.model_validate(fields)


def test_triplet_rejects_negative_token_id_naming_the_field() -> None:
    with pytest.raises(ValidationError) as err:
        Triplet(prompt_token_ids=[1, -2], response_token_ids=[3])
    assert err.value.errors()[0]["loc"] == ("prompt_token_ids", 1)


def test_triplet_rejects_non_integer_token_ids() -> None:
    for bad in (1.0, True, "3"):
        with pytest.raises(ValidationError) as err:
            Triplet.model_validate({"prompt_token_ids": [1], "response_token_ids": [bad]})
        assert err.value.errors()[0]["loc"] == ("response_token_ids", 0)


def test_triplet_rejects_log_probs_of_another_length() -> None:
    with pytest.raises(ValidationError, match="response_log_probs has 1 values but response_token_ids has 2"):
        Triplet(prompt_token_ids=[1], response_token_ids=[2, 3], response_log_probs=[-0.1])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_triplet_rejects_non_finite_log_probs(bad: float) -> None:
    with pytest.raises(ValidationError, match=r"response_log_probs\[1\] is"):
        Triplet(prompt_token_ids=[1], response_token_ids=[2, 3], response_log_probs=[-0.1, bad])


@pytest.mark.parametrize("bad", ["-0.5", True])
def test_triplet_rejects_log_probs_that_are_not_numbers(bad: object) -> None:
    with pytest.raises(ValidationError) as err:
        Triplet.model_validate(
            {"prompt_token_ids": [1], "response_token_ids": [2], "response_log_probs": [bad]}
        )
    assert [(e["loc"], e["type"]) for e in err.value.errors()] == [(("response_log_probs", 0), "float_type")]


def test_triplet_accepts_integer_and_signed_zero_log_probs() -> None:
    triplet = Triplet.model_validate_json(
        '{"prompt_token_ids": [1], "response_token_ids": [2, 3, 4], "response_log_probs": [0, -0.0, -2]}'
    )
    assert triplet.response_log_probs == [0.0, -0.0, -2.0]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_triplet_rejects_non_finite_reward_naming_the_field(bad: float) -> None:
    with pytest.raises(ValidationError) as err:
        Triplet(prompt_token_ids=[1], response_token_ids=[2], reward=bad)
    (error,) = err.value.errors()
    assert error["loc"] == ("reward",)
    assert error["msg"] == f"Value error, reward is {bad}; a reward must be finite or None"


def test_triplet_accepts_missing_reward_and_log_probs() -> None:
    triplet = Triplet(prompt_token_ids=[], response_token_ids=[5])
    assert triplet.reward is None
    assert triplet.response_log_probs is None


def test_triplet_weight_version_reads_server_metadata() -> None:
    assert (
        Triplet(
            prompt_token_ids=[1], response_token_ids=[2], metadata={"server": {"version": 7}}
        ).weight_version
        == 7
    )
    assert Triplet(prompt_token_ids=[1], response_token_ids=[2]).weight_version is None


def test_triplet_is_frozen() -> None:
    triplet = Triplet(prompt_token_ids=[1], response_token_ids=[2])
    with pytest.raises(ValidationError):
        triplet.reward = 1.0  # type: ignore[misc]


def test_triplet_repr_is_compact() -> None:
    triplet = Triplet(prompt_token_ids=list(range(1000)), response_token_ids=[1, 2], reward=0.5)
    assert repr(triplet) == "Triplet(prompt=1000 ids, response=2 ids, log_probs=no, reward=0.5)"


def test_triplet_image_urls_default_to_none_and_must_be_strings() -> None:
    assert Triplet(prompt_token_ids=[1], response_token_ids=[2]).image_urls is None
    urls = ["data:image/png;base64,AAAA", "file:///tmp/a.png"]
    assert Triplet(prompt_token_ids=[1], response_token_ids=[2], image_urls=urls).image_urls == urls
    with pytest.raises(ValidationError) as err:
        Triplet(prompt_token_ids=[1], response_token_ids=[2], image_urls=[{"url": "x"}])  # type: ignore[list-item]
    assert err.value.errors()[0]["loc"] == ("image_urls", 0)


def test_completed_rollout_json_round_trip_is_exact() -> None:
    rollout = _completed(final_reward=0.1, input={"question": "2+2", "n": [1, 2]}, metadata={"k": "v"})
    again = CompletedRollout.model_validate_json(rollout.model_dump_json())
    assert again == rollout
    assert again.final_reward == 0.1


def test_completed_rollout_accepts_missing_reward() -> None:
    assert _completed(final_reward=None).final_reward is None


def test_completed_rollout_rejects_non_terminal_state() -> None:
    with pytest.raises(ValidationError, match="must be succeeded or failed"):
        _completed(rollout_state="running")


def test_completed_rollout_rejects_non_finite_reward() -> None:
    with pytest.raises(ValidationError) as err:
        _completed(final_reward=math.nan)
    (error,) = err.value.errors()
    assert error["loc"] == ("final_reward",)
    assert error["msg"] == "Value error, final_reward is nan; a reward must be finite or None"


def test_completed_rollout_repr_is_compact() -> None:
    assert repr(_completed()) == (
        "CompletedRollout(id=r1, data_id=d1, step=3, sample=1, state=succeeded, reward=1.0, turns=1)"
    )


def test_enqueued_rollout_validates_assignment() -> None:
    enqueued = EnqueuedRollout(rollout_id="r", data_id="d", step=0, sample_idx_in_step=0, enqueue_time=1.0)
    enqueued.running_at = 2.5
    assert enqueued.running_at == 2.5
    with pytest.raises(ValidationError):
        enqueued.step = -1
