"""``serving/calls_share/<i>``: each server's share of a step's model calls, from the endpoint each
call's triplet carries (agl-rollout reads it from the raw events with ``include_endpoints``)."""

from __future__ import annotations

from agl_trainer.serving.fleet import calls_share
from agl_types import CompletedRollout, RolloutState, Triplet

ENDPOINTS = ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8001/v1")


def _rollout(*endpoints: str | None) -> CompletedRollout:
    triplets = [
        Triplet(
            prompt_token_ids=[1],
            response_token_ids=[2],
            metadata={"server": {"model": "m", **({"endpoint": e} if e is not None else {})}},
        )
        for e in endpoints
    ]
    return CompletedRollout(
        rollout_id="r",
        data_id="d",
        step=1,
        sample_idx_in_step=0,
        enqueue_time=0.0,
        triplets=triplets,
        rollout_state=RolloutState.SUCCEEDED,
    )


def test_each_servers_share_counts_the_calls_its_endpoint_served() -> None:
    rollouts = [_rollout(ENDPOINTS[0], ENDPOINTS[1], ENDPOINTS[1]), _rollout(ENDPOINTS[1], None)]
    assert calls_share(rollouts, ENDPOINTS) == {"serving/calls_share/0": 0.25, "serving/calls_share/1": 0.75}


def test_a_call_to_a_route_on_a_server_counts_for_that_server() -> None:
    """A LoRA run registers ``/agl/adapters/current/v1`` on each server, not the endpoint itself."""
    route = "http://127.0.0.1:8001/agl/adapters/current/v1"
    assert calls_share([_rollout(route, ENDPOINTS[0])], ENDPOINTS) == {
        "serving/calls_share/0": 0.5,
        "serving/calls_share/1": 0.5,
    }


def test_no_share_is_logged_when_no_call_records_its_endpoint() -> None:
    assert calls_share([_rollout(None, None)], ENDPOINTS) == {}
