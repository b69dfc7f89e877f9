"""Shapes and helpers of the wire models, without a server."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agl_types import (
    TERMINAL_STATES,
    ModelRequestData,
    RolloutCreate,
    RolloutState,
    RolloutStatusPatch,
    ServerRef,
    TripletModelRequestData,
    is_terminal,
)


def test_terminal_states_are_succeeded_and_failed() -> None:
    assert frozenset({RolloutState.SUCCEEDED, RolloutState.FAILED}) == TERMINAL_STATES
    assert [is_terminal(s) for s in ("queuing", "running", "succeeded", "failed")] == [
        False,
        False,
        True,
        True,
    ]


def test_is_terminal_rejects_unknown_state() -> None:
    with pytest.raises(ValueError, match="'cancelled' is not a valid RolloutState"):
        is_terminal("cancelled")


def test_rollout_create_dumps_the_server_body() -> None:
    body = RolloutCreate(input={"q": 1}, rollout_id="abc", config={"timeout_seconds": 30}).model_dump(  # type: ignore[arg-type]
        mode="json", exclude_none=True
    )
    assert body == {
        "input": {"q": 1},
        "is_train": True,
        "config": {"timeout_seconds": 30},
        "rollout_id": "abc",
    }


def test_rollout_create_to_wire_keeps_a_null_input() -> None:
    assert RolloutCreate(input=None, rollout_id="abc").to_wire() == {
        "input": None,
        "is_train": True,
        "rollout_id": "abc",
    }


def test_rollout_config_rejects_non_positive_timeout() -> None:
    with pytest.raises(ValidationError) as err:
        RolloutCreate.model_validate({"input": None, "config": {"timeout_seconds": 0}})
    assert err.value.errors()[0]["loc"] == ("config", "timeout_seconds")


def test_status_patch_forbids_unknown_keys_like_the_server() -> None:
    with pytest.raises(ValidationError) as err:
        RolloutStatusPatch.model_validate({"state": "running", "progress": 3})
    assert err.value.errors()[0]["loc"] == ("progress",)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"status": "ok", "http_status": 200}, False),
        ({"status": "error"}, True),
        ({"http_status": 400}, True),
        ({"error": {"message": "bad"}}, True),
    ],
)
def test_triplet_model_request_is_error(data: dict[str, object], expected: bool) -> None:
    assert TripletModelRequestData.model_validate(data).is_error is expected


@pytest.mark.parametrize("bad", ["-0.5", True])
def test_triplet_model_request_rejects_log_probs_that_are_not_numbers(bad: object) -> None:
    with pytest.raises(ValidationError) as err:
        TripletModelRequestData.model_validate({"response_token_ids": [4], "response_log_probs": [bad]})
    assert [(e["loc"], e["type"]) for e in err.value.errors()] == [(("response_log_probs", 0), "float_type")]


def test_model_request_data_keeps_the_serving_endpoint() -> None:
    data = ModelRequestData.model_validate(
        {
            "model": "m",
            "server": {"model": "m", "endpoint": "http://x/v1", "version": 2},
            "routed_experts": None,
        }
    )
    assert data.server == ServerRef(model="m", endpoint="http://x/v1", version=2)


def test_triplet_model_request_keeps_the_moe_routes_payload_and_refuses_a_non_string() -> None:
    data = TripletModelRequestData.model_validate({"response_token_ids": [4], "routed_experts": "k05VTVBZ"})
    assert data.routed_experts == "k05VTVBZ"
    assert TripletModelRequestData.model_validate({"response_token_ids": [4]}).routed_experts is None
    with pytest.raises(ValidationError) as err:
        TripletModelRequestData.model_validate({"response_token_ids": [4], "routed_experts": [[1, 2]]})
    assert [e["loc"] for e in err.value.errors()] == [("routed_experts",)]
