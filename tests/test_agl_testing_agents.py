"""The fake agents themselves: they claim only their test's rollouts and never swallow an error."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from agl_rollout import AglClient, model_registrations
from agl_testing.agents import AgentBehaviour, FakeAgentError, FakeAgents
from agl_testing.agl_server import TEST_KEY, TEST_MODEL_NAME, AglServerProcess
from agl_testing.fake_upstream import HeldCompletions
from agl_testing.http import call

pytestmark = pytest.mark.server


def _create(server: AglServerProcess, x: int) -> str:
    rid = uuid.uuid4().hex
    reply = call(
        "POST", f"{server.url}/api/rollouts", key=TEST_KEY, json_body=[{"input": {"x": x}, "rollout_id": rid}]
    )
    assert reply.status == 201, reply.body
    return rid


def _state(server: AglServerProcess, rid: str) -> dict[str, Any]:
    return call("GET", f"{server.url}/api/rollouts/{rid}", key=TEST_KEY).body["rollout"]["status"]


def _wait_terminal(server: AglServerProcess, rid: str, timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while (status := _state(server, rid))["state"] not in {"succeeded", "failed"}:
        assert time.monotonic() < deadline, f"rollout {rid} still {status['state']} after {timeout_s} s"
        time.sleep(0.02)
    return status


def test_a_rollout_created_before_the_agents_started_is_left_alone(agl_server: AglServerProcess) -> None:
    foreign = _create(agl_server, 0)
    with FakeAgents(agl_server.url) as agents:
        own = _create(agl_server, 1)
        _wait_terminal(agl_server, own)
    assert agents.stats.claimed == [own]
    assert _state(agl_server, foreign)["state"] == "queuing"
    agl_server.delete_rollouts([foreign, own])


def test_an_exception_in_a_behaviour_fails_the_rollout_at_once_and_the_test_with_its_traceback(
    agl_server: AglServerProcess,
) -> None:
    def behaviour(rollout: dict[str, Any]) -> AgentBehaviour:
        return AgentBehaviour(reward=1.0 / rollout["input"]["x"])

    agents = FakeAgents(agl_server.url, behaviour=behaviour).start()
    rid = _create(agl_server, 0)
    status = _wait_terminal(agl_server, rid)
    with pytest.raises(FakeAgentError) as info:
        agents.stop()
    assert (status["state"], status["error_message"]) == ("failed", "the fake agent's behaviour raised")
    assert "ZeroDivisionError: float division by zero" in str(info.value)
    assert "in behaviour" in str(info.value)  # the traceback names the frame that raised
    agl_server.delete_rollouts([rid])


def test_a_failing_test_keeps_its_own_exception_with_the_agents_errors_attached(
    agl_server: AglServerProcess,
) -> None:
    rid = ""
    with (
        pytest.raises(RuntimeError, match="the test's own failure") as info,
        FakeAgents(agl_server.url, behaviour=lambda r: AgentBehaviour(reward=r["input"]["missing"])),
    ):
        rid = _create(agl_server, 0)
        _wait_terminal(agl_server, rid)
        raise RuntimeError("the test's own failure")
    assert any("KeyError: 'missing'" in note for note in info.value.__notes__)
    agl_server.delete_rollouts([rid])


def test_an_agent_through_the_gateway_gets_its_calls_recorded_with_the_registered_version(
    fresh_agl_server: AglServerProcess,
) -> None:
    with HeldCompletions(echo=True) as upstream, AglClient(fresh_agl_server.url, TEST_KEY) as client:
        client.register_models(
            model_registrations(TEST_MODEL_NAME, [f"http://{upstream.address}/v1"], version=7)
        )
        client.resume()
        with FakeAgents(
            fresh_agl_server.url, behaviour=AgentBehaviour(turns=2, reward=0.5, via_gateway=True)
        ):
            rid = _create(fresh_agl_server, 1)
            status = _wait_terminal(fresh_agl_server, rid)
        calls = client.get_events(rid, event_type="model_request")
        client.delete_rollout(rid)
    assert status["state"] == "succeeded"
    assert [(e.data["server"]["version"], e.data["request"]["prompt"]) for e in calls] == [
        (7, [1, 2, 3]),
        (7, [1, 2, 3, 13, 23, 30]),
    ]


def test_an_agent_through_the_gateway_cannot_also_write_a_version() -> None:
    with pytest.raises(ValueError, match="records nothing itself"):
        AgentBehaviour(via_gateway=True, weight_version=3)
