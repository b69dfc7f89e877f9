"""Every wire model round-trips through the real agl-server process."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from agl_testing.agl_server import AglServerProcess
from agl_testing.http import Reply, call
from agl_types import (
    Event,
    EventCreate,
    ModelRegistration,
    ModelRequestData,
    PauseRequest,
    PauseState,
    RewardData,
    Rollout,
    RolloutConfig,
    RolloutCreate,
    RolloutDetail,
    RolloutPatch,
    RolloutState,
    RolloutStatusPatch,
    ServerRef,
    TerminalRolloutsPage,
    TripletModelRequestData,
)

pytestmark = pytest.mark.server


def _api(server: AglServerProcess, method: str, path: str, body: Any = None) -> Reply:
    return call(method, server.url + path, key=server.key, json_body=body)


_created: list[tuple[AglServerProcess, str]] = []


@pytest.fixture(autouse=True)
def _delete_created(agl_server: AglServerProcess) -> Iterator[None]:
    """Delete what the test created on the shared server, before ``agl_server`` checks that the
    test left nothing (a test's own ``fresh_agl_server`` is gone by then, and empty with it)."""
    yield
    for server, rid in _created:
        if server is agl_server:
            _api(server, "DELETE", f"/api/rollouts/{rid}")
    _created.clear()


def _create(server: AglServerProcess, *requests: RolloutCreate) -> list[Rollout]:
    reply = _api(server, "POST", "/api/rollouts", [r.to_wire() for r in requests])
    assert reply.status == 201, reply.body
    rollouts = [Rollout.model_validate(item) for item in reply.body]
    _created.extend((server, r.rollout_id) for r in rollouts)
    return rollouts


def _patch(server: AglServerProcess, rollout_id: str, status: RolloutStatusPatch) -> Reply:
    body = RolloutPatch(status=status).model_dump(mode="json", exclude_unset=True)
    return _api(server, "PATCH", f"/api/rollouts/{rollout_id}", body)


def _new_id() -> str:
    return uuid.uuid4().hex


def test_create_with_client_id_returns_that_rollout(agl_server: AglServerProcess) -> None:
    rid = _new_id()
    request = RolloutCreate(
        input={"data_id": "g1", "question": "1+1"},
        rollout_id=rid,
        config=RolloutConfig(timeout_seconds=30),
        metadata={"sample_idx_in_batch": 2, "tag": "x"},  # type: ignore[arg-type]
    )
    (rollout,) = _create(agl_server, request)
    assert rollout.rollout_id == rid
    assert rollout.input == {"data_id": "g1", "question": "1+1"}
    assert rollout.config.timeout_seconds == 30
    assert rollout.metadata.sample_idx_in_batch == 2
    assert rollout.metadata.model_extra == {"tag": "x"}
    assert rollout.state is RolloutState.QUEUING


def test_create_twice_with_the_same_id_returns_the_existing_rollout(agl_server: AglServerProcess) -> None:
    rid = _new_id()
    (first,) = _create(agl_server, RolloutCreate(input={"v": 1}, rollout_id=rid))
    (second,) = _create(agl_server, RolloutCreate(input={"v": 2}, rollout_id=rid))
    assert second == first


def test_get_returns_rollout_detail(agl_server: AglServerProcess) -> None:
    (rollout,) = _create(agl_server, RolloutCreate(input=None, rollout_id=_new_id()))
    reply = _api(agl_server, "GET", f"/api/rollouts/{rollout.rollout_id}")
    detail = RolloutDetail.model_validate(reply.body)
    assert detail.rollout == rollout
    assert detail.attempts == []


def test_patch_moves_state_and_bumps_version(agl_server: AglServerProcess) -> None:
    (rollout,) = _create(agl_server, RolloutCreate(input=None, rollout_id=_new_id()))
    reply = _patch(
        agl_server, rollout.rollout_id, RolloutStatusPatch(state=RolloutState.RUNNING, last_attempt_id="0")
    )
    patched = Rollout.model_validate(reply.body)
    assert patched.state is RolloutState.RUNNING
    assert patched.status.version == 2
    assert patched.status.updated_at >= rollout.status.updated_at
    reply = _patch(
        agl_server, rollout.rollout_id, RolloutStatusPatch(state=RolloutState.FAILED, error_message="boom")
    )
    failed = Rollout.model_validate(reply.body)
    assert (failed.state, failed.status.error_message) == (RolloutState.FAILED, "boom")


def test_invalid_transition_is_a_409_naming_both_states(agl_server: AglServerProcess) -> None:
    (rollout,) = _create(agl_server, RolloutCreate(input=None, rollout_id=_new_id()))
    reply = _patch(agl_server, rollout.rollout_id, RolloutStatusPatch(state=RolloutState.SUCCEEDED))
    assert reply.status == 409
    assert reply.body["detail"] == f"Rollout {rollout.rollout_id}: cannot transition queuing -> succeeded"


def test_events_round_trip_raw_and_triplet(agl_server: AglServerProcess) -> None:
    (rollout,) = _create(agl_server, RolloutCreate(input=None, rollout_id=_new_id()))
    rid = rollout.rollout_id
    request = ModelRequestData(
        model="m",
        model_version=3,
        request={"model": "m", "prompt": [1, 2, 3]},
        response={
            "choices": [
                {
                    "prompt_token_ids": [1, 2, 3],
                    "token_ids": [4, 5],
                    "logprobs": {"token_logprobs": [-0.5, -0.25]},
                }
            ]
        },
        server=ServerRef(model="m", endpoint="http://x/v1", version=3),
        latency_ms=12.5,
        http_status=200,
        finish_reason="stop",
    )
    posted: list[Event] = []
    for create in (
        EventCreate(event_type="model_request", data=request.model_dump(mode="json", exclude_none=True)),
        EventCreate(
            event_type="reward",
            data=RewardData(value=0.75, message="m", source="agent").model_dump(exclude_none=True),
        ),
    ):
        reply = _api(
            agl_server, "POST", f"/api/rollouts/{rid}/attempt/0/events", create.model_dump(mode="json")
        )
        assert reply.status == 200, reply.body
        posted.append(Event.model_validate(reply.body))

    raw = [Event.model_validate(e) for e in _api(agl_server, "GET", f"/api/rollouts/{rid}/events").body]
    assert raw == posted
    assert ModelRequestData.model_validate(raw[0].data) == request

    triplet = [
        Event.model_validate(e)
        for e in _api(agl_server, "GET", f"/api/rollouts/{rid}/events?format=triplet").body
    ]
    assert [e.event_type for e in triplet] == ["model_request", "reward"]
    data = TripletModelRequestData.model_validate(triplet[0].data)
    assert (data.prompt_token_ids, data.response_token_ids, data.response_log_probs) == (
        [1, 2, 3],
        [4, 5],
        [-0.5, -0.25],
    )
    assert (data.server.model, data.server.version, data.is_error) == ("m", 3, False)
    assert triplet[1].data == {"value": 0.75, "source": "agent"}


def test_terminal_page_lists_finished_rollouts_after_cursor(fresh_agl_server: AglServerProcess) -> None:
    rollouts = _create(
        fresh_agl_server, *(RolloutCreate(input={"data_id": f"g{i}"}, rollout_id=_new_id()) for i in range(3))
    )
    for r in rollouts[:2]:
        assert (
            _patch(fresh_agl_server, r.rollout_id, RolloutStatusPatch(state=RolloutState.FAILED)).status
            == 200
        )
    page = TerminalRolloutsPage.model_validate(
        _api(fresh_agl_server, "GET", "/api/rollouts/terminal?after=0").body
    )
    assert [(i.rollout_id, i.state, i.data_id) for i in page.items] == [
        (rollouts[0].rollout_id, RolloutState.FAILED, "g0"),
        (rollouts[1].rollout_id, RolloutState.FAILED, "g1"),
    ]
    assert (page.next_after, page.total_terminal) == (2, 2)
    later = TerminalRolloutsPage.model_validate(
        _api(fresh_agl_server, "GET", "/api/rollouts/terminal?after=2").body
    )
    assert later.items == []


def test_delete_removes_rollout_and_events(agl_server: AglServerProcess) -> None:
    (rollout,) = _create(agl_server, RolloutCreate(input=None, rollout_id=_new_id()))
    assert _api(agl_server, "DELETE", f"/api/rollouts/{rollout.rollout_id}").status == 204
    reply = _api(agl_server, "GET", f"/api/rollouts/{rollout.rollout_id}")
    assert (reply.status, reply.body) == (404, {"detail": f"Rollout not found: {rollout.rollout_id}"})


def test_model_registration_round_trips(agl_server: AglServerProcess) -> None:
    models = [ModelRegistration(model="m", endpoint="http://127.0.0.1:9/v1", version=4)]
    reply = _api(agl_server, "POST", "/api/models", [m.model_dump() for m in models])
    assert reply.status == 201
    assert [ModelRegistration.model_validate(m) for m in reply.body] == models
    assert _api(agl_server, "DELETE", "/api/models").body == {"status": "ok"}


def test_pause_and_resume_round_trip(agl_server: AglServerProcess) -> None:
    paused = PauseState.model_validate(
        _api(agl_server, "POST", "/proxy/pause", PauseRequest(reason="update").model_dump()).body
    )
    assert (paused.paused, paused.reason, paused.inflight) == (True, "update", 0)
    resumed = PauseState.model_validate(_api(agl_server, "POST", "/proxy/resume").body)
    assert (resumed.paused, resumed.reason) == (False, None)
    assert PauseState.model_validate(_api(agl_server, "GET", "/proxy/state").body) == resumed


def test_create_body_that_is_not_a_list_is_a_422_naming_the_body(agl_server: AglServerProcess) -> None:
    reply = _api(agl_server, "POST", "/api/rollouts", {"input": 1})
    assert reply.status == 422
    assert reply.body["detail"][0]["loc"] == ["body"]


def test_missing_key_is_a_401(agl_server: AglServerProcess) -> None:
    reply = call("GET", agl_server.url + "/api/rollouts/terminal")
    assert (reply.status, reply.body) == (401, {"detail": "Invalid or missing API key"})
