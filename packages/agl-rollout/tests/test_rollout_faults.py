"""Faults between client and server: dropped answers, reset connections, a restarted server."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter

import pytest

from agl_rollout import (
    AglClient,
    AglHTTPError,
    AglServerError,
    AglUnavailableError,
    RetryPolicy,
    RolloutManagerConfig,
    RolloutsLostError,
    SyncRolloutManager,
)
from agl_rollout.recovery import MAX_RECOVERIES_PER_WAIT
from agl_testing.agents import AgentBehaviour, FakeAgents
from agl_testing.agl_server import (
    TEST_KEY,
    TEST_MODEL_NAME,
    AglServerProcess,
    once_it_holds_a_rollout,
    restart_once_it_holds_a_rollout,
)
from agl_testing.fake_upstream import HeldCompletions
from agl_testing.fault_proxy import FaultProxy
from agl_testing.http import call
from agl_types import EventCreate, ModelRegistration, RolloutCreate, RolloutState

pytestmark = [pytest.mark.server, pytest.mark.timeout(120)]  # a hang fails in minutes, not CI's 1200 s

CONFIG = RolloutManagerConfig(train_rollout_n=2, poll_interval_seconds=0.02)
FAST_RETRY = RetryPolicy(max_attempts=100, base_delay_s=0.05, max_delay_s=0.5, deadline_s=20.0)


def test_create_whose_answer_is_lost_is_retried_without_a_duplicate(
    fresh_agl_server: AglServerProcess,
) -> None:
    with FaultProxy(fresh_agl_server.port) as proxy:
        proxy.inject("POST", "/api/rollouts", "drop_response")
        proxy.inject("POST", "/api/rollouts", "reset")
        proxy.inject("GET", "/api/rollouts/terminal", "reset", times=2)
        proxy.inject("GET", "/api/rollouts/", "drop_response", times=2)
        with (
            AglClient(proxy.url, TEST_KEY, retry=FAST_RETRY) as client,
            FakeAgents(fresh_agl_server.url) as agents,
        ):
            result = SyncRolloutManager(client, CONFIG).enqueue_and_wait_until_completed(
                [{"x": i} for i in range(4)], is_train=True
            )
        faults = Counter((method, fault) for method, _, fault in proxy.injected)
    with AglClient(fresh_agl_server.url, TEST_KEY) as direct:
        n_terminal = direct.terminal_page(0).total_terminal
        left = direct.list_rollouts(list(RolloutState))
    assert agents.stats.errors == []
    assert n_terminal == 8
    assert left == []
    ids = [r.rollout_id for r in result.completed]
    assert len(ids) == len(set(ids)) == 8
    assert sorted(agents.stats.claimed) == sorted(ids)  # the server never held a ninth rollout
    assert faults[("POST", "drop_response")] == 1 and faults[("POST", "reset")] == 1
    assert faults[("GET", "reset")] == 2 and faults[("GET", "drop_response")] == 2


def test_a_dropped_response_is_retried_at_once_on_a_new_connection_and_a_refused_one_backs_off(
    agl_server: AglServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    slow = RetryPolicy(max_attempts=4, base_delay_s=0.3, max_delay_s=0.3, jitter=0.0, deadline_s=20.0)
    with FaultProxy(agl_server.port) as proxy, AglClient(proxy.url, TEST_KEY, retry=slow) as client:
        proxy.inject("GET", "/api/rollouts/terminal", "drop_response", times=3)
        with caplog.at_level(logging.WARNING, logger="agl_rollout"):
            page = client.terminal_page(0)
    with (
        AglClient("http://127.0.0.1:9", TEST_KEY, retry=slow) as nowhere,
        caplog.at_level(logging.WARNING, logger="agl_rollout"),
        pytest.raises(AglUnavailableError, match="failed after 4 tries"),
    ):
        nowhere.terminal_page(0)
    delays = [
        float(r.getMessage().rsplit("retry_in_s=", 1)[1])
        for r in caplog.records
        if "retry_in_s=" in r.getMessage()
    ]
    assert page.total_terminal >= 0
    assert [path for _, path in proxy.requests] == ["/api/rollouts/terminal?after=0&limit=1000"] * 4
    assert delays == [0.0, 0.0, 0.0, 0.3, 0.3, 0.3]


def test_server_restart_during_a_sync_wait_recreates_the_lost_rollouts_and_their_model(
    fresh_agl_server: AglServerProcess,
) -> None:
    restarted, lost = threading.Event(), set[str]()
    config = RolloutManagerConfig(poll_interval_seconds=0.05, rollout_timeout_seconds=120.0)
    with (
        HeldCompletions() as upstream,
        AglClient(fresh_agl_server.url, TEST_KEY, retry=FAST_RETRY) as client,
    ):
        client.register_models(
            [ModelRegistration(model=TEST_MODEL_NAME, endpoint=f"http://{upstream.address}/v1")]
        )
        # Every agent waits for the restart to be over, so the lost rollouts' agents fail to
        # finish them on the new server, on purpose.
        held = AgentBehaviour(reward=0.5, wait_for=restarted)
        with FakeAgents(fresh_agl_server.url, behaviour=held, check_errors=False):
            restarter = restart_once_it_holds_a_rollout(fresh_agl_server, restarted, lost)
            restarter.start()
            result = SyncRolloutManager(client, config).enqueue_and_wait_until_completed(
                [{"x": 1}, {"x": 2}], is_train=True
            )
            restarter.join()
        [probe] = client.create_rollouts([RolloutCreate(input=None, rollout_id=uuid.uuid4().hex)])
        served = call(
            "POST",
            f"{fresh_agl_server.url}/proxy/rollout/{probe.rollout_id}/attempt/0/mode/val/openai/v1/completions",
            key=TEST_KEY,
            json_body={"model": TEST_MODEL_NAME, "prompt": [1, 2], "max_tokens": 1},
        )
        client.delete_rollout(probe.rollout_id)
    assert sorted((r.input["x"], r.rollout_state, r.final_reward) for r in result.completed) == [
        (1, RolloutState.SUCCEEDED, 0.5),
        (2, RolloutState.SUCCEEDED, 0.5),
    ]
    assert result.metrics["training/n_rollouts_recreated"] == 2.0
    assert len(lost) == 2 and lost.isdisjoint(r.rollout_id for r in result.completed)
    assert served.status == 200, f"the model registration was not restored: {served.body}"


def test_rollouts_deleted_again_and_again_end_the_wait_with_a_clear_error(
    fresh_agl_server: AglServerProcess,
) -> None:
    config = RolloutManagerConfig(poll_interval_seconds=0.02)
    stop = threading.Event()

    def delete_everything() -> None:
        while not stop.is_set():
            fresh_agl_server.delete_rollouts(fresh_agl_server.rollout_ids())
            time.sleep(0.02)

    deleter = threading.Thread(target=delete_everything, daemon=True)
    with AglClient(fresh_agl_server.url, TEST_KEY) as client:
        deleter.start()
        try:
            with pytest.raises(RolloutsLostError, match=f"after {MAX_RECOVERIES_PER_WAIT} re-creations"):
                SyncRolloutManager(client, config).enqueue_and_wait_until_completed([{"x": 1}], is_train=True)
        finally:
            stop.set()
            deleter.join()


def test_server_that_stays_down_raises_an_unavailable_error_after_the_retry_deadline(
    fresh_agl_server: AglServerProcess,
) -> None:
    retry = RetryPolicy(base_delay_s=0.05, max_delay_s=0.2, deadline_s=1.0)
    config = RolloutManagerConfig(poll_interval_seconds=0.05)
    with (
        AglClient(fresh_agl_server.url, TEST_KEY, retry=retry) as client,
        FakeAgents(  # the server goes away under its polls on purpose
            fresh_agl_server.url, behaviour=AgentBehaviour(outcome="never_start"), check_errors=False
        ),
    ):
        once_it_holds_a_rollout(fresh_agl_server, fresh_agl_server.stop).start()
        with pytest.raises(AglServerError, match="check that agl-server is running"):
            SyncRolloutManager(client, config).enqueue_and_wait_until_completed([{"x": 1}], is_train=True)


def _one_rollout(client: AglClient) -> str:
    [rollout] = client.create_rollouts([RolloutCreate(input={"x": 0}, rollout_id=uuid.uuid4().hex)])
    return rollout.rollout_id


def test_a_503_answer_to_an_idempotent_call_is_retried(agl_server: AglServerProcess) -> None:
    with FaultProxy(agl_server.port) as proxy, AglClient(proxy.url, TEST_KEY, retry=FAST_RETRY) as client:
        rid = _one_rollout(client)
        proxy.inject("GET", f"/api/rollouts/{rid}", "answer_503", times=2)
        before = client.request_count
        detail = client.get_rollout(rid)
        n_requests = client.request_count - before
        client.delete_rollout(rid)
    assert detail.rollout.rollout_id == rid
    assert n_requests == 3
    assert [fault for _, _, fault in proxy.injected] == ["answer_503", "answer_503"]


def test_a_503_answer_to_post_event_is_not_retried(agl_server: AglServerProcess) -> None:
    event = EventCreate(event_type="reward", data={"value": 1.0})
    with FaultProxy(agl_server.port) as proxy, AglClient(proxy.url, TEST_KEY, retry=FAST_RETRY) as client:
        rid = _one_rollout(client)
        proxy.inject("POST", f"/api/rollouts/{rid}/attempt/0/events", "answer_503")
        before = client.request_count
        with pytest.raises(AglHTTPError, match="HTTP 503"):
            client.post_event(rid, "0", event)
        n_requests = client.request_count - before
        events = client.get_events(rid)
        client.delete_rollout(rid)
    assert n_requests == 1
    assert events == []


def test_post_event_whose_answer_is_lost_is_not_retried_into_a_duplicate(
    agl_server: AglServerProcess,
) -> None:
    event = EventCreate(event_type="reward", data={"value": 1.0})
    with FaultProxy(agl_server.port) as proxy, AglClient(proxy.url, TEST_KEY, retry=FAST_RETRY) as client:
        rid = _one_rollout(client)
        proxy.inject("POST", f"/api/rollouts/{rid}/attempt/0/events", "drop_response")
        with pytest.raises(AglUnavailableError, match="failed after 1 try"):
            client.post_event(rid, "0", event)
        events = client.get_events(rid)
        client.delete_rollout(rid)
    assert [(e.event_type, e.data) for e in events] == [("reward", {"value": 1.0})]
