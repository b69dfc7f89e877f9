"""Hooks through the managers against the real server: rewrite, write-back, exceptions, once each."""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from typing import Any

import pytest

from agl_rollout import (
    AglClient,
    RolloutBatchResult,
    RolloutHooks,
    RolloutManagerConfig,
    SyncRolloutManager,
    TraceWriter,
)
from agl_testing.agents import AgentBehaviour, FakeAgents
from agl_testing.agl_server import TEST_KEY, AglServerProcess
from agl_types import CompletedRollout, Event, Rollout, RolloutCreate

pytestmark = [pytest.mark.server, pytest.mark.timeout(120)]  # a hang fails in minutes, not CI's 1200 s

FAST = RolloutManagerConfig(train_rollout_n=2, poll_interval_seconds=0.02, rollout_timeout_seconds=30.0)


class RecordingHooks(RolloutHooks):
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.seen_events: dict[str, list[str]] = {}

    def on_enqueue(self, request: RolloutCreate) -> RolloutCreate:
        self.calls.append(("enqueue", ""))
        return request.model_copy(
            update={"input": {**request.input, "hooked": True}, "rollout_id": "hook-id"}
        )

    def on_succeeded(self, rollout: Rollout, events: dict[str, list[Event]], store: TraceWriter) -> None:
        self.calls.append(("succeeded", rollout.rollout_id))
        self.seen_events[rollout.rollout_id] = [e.event_type for e in events[rollout.visible_attempt_id]]
        store.add_event(rollout.rollout_id, rollout.visible_attempt_id, "reward", {"value": 5.0})

    def on_failed(self, rollout: Rollout, events: dict[str, list[Event]], store: TraceWriter) -> None:
        self.calls.append(("failed", rollout.rollout_id))
        self.seen_events[rollout.rollout_id] = [e.event_type for e in events[rollout.visible_attempt_id]]
        store.add_event(rollout.rollout_id, rollout.visible_attempt_id, "reward", {"value": -1.0})


def _wait(server: AglServerProcess, hooks: RolloutHooks, behaviour: Any) -> RolloutBatchResult:
    with AglClient(server.url, TEST_KEY) as client, FakeAgents(server.url, behaviour=behaviour) as agents:
        manager = SyncRolloutManager(client, FAST, hooks=hooks)
        result = manager.enqueue_and_wait_until_completed([{"x": 0}, {"x": 1}], is_train=True)
    assert agents.stats.errors == []
    return result


def _run(server: AglServerProcess, hooks: RolloutHooks, behaviour: Any) -> list[CompletedRollout]:
    return _wait(server, hooks, behaviour).completed


def test_on_enqueue_rewrites_each_request_but_cannot_choose_the_id(agl_server: AglServerProcess) -> None:
    hooks = RecordingHooks()
    completed = _run(agl_server, hooks, AgentBehaviour())
    assert [c for c, _ in hooks.calls].count("enqueue") == 4
    assert all(r.input["hooked"] is True for r in completed)
    assert len({r.rollout_id for r in completed}) == 4 and "hook-id" not in {r.rollout_id for r in completed}


def test_on_succeeded_sees_the_events_and_its_reward_write_back_sets_the_final_reward(
    agl_server: AglServerProcess,
) -> None:
    hooks = RecordingHooks()
    completed = _run(agl_server, hooks, AgentBehaviour(reward=1.0))
    assert [r.final_reward for r in completed] == [5.0] * 4
    assert all(r.triplets[-1].reward == 5.0 for r in completed)
    assert set(map(tuple, hooks.seen_events.values())) == {("model_request", "reward")}


def test_on_failed_sees_the_events_and_its_reward_write_back_sets_the_final_reward(
    agl_server: AglServerProcess,
) -> None:
    hooks = RecordingHooks()
    completed = _run(agl_server, hooks, AgentBehaviour(outcome="failed", reward=1.0))
    assert [r.final_reward for r in completed] == [-1.0] * 4
    assert all(r.triplets[-1].reward == -1.0 for r in completed)
    assert set(map(tuple, hooks.seen_events.values())) == {("model_request", "reward")}


class RouteSeeingHooks(RolloutHooks):
    def __init__(self) -> None:
        self.routes: list[object] = []

    def on_succeeded(self, rollout: Rollout, events: dict[str, list[Event]], store: TraceWriter) -> None:
        calls = [e for e in events[rollout.visible_attempt_id] if e.event_type == "model_request"]
        self.routes += [e.data.get("routed_experts", "absent") for e in calls]


def test_hooks_see_events_without_moe_routes_even_when_the_triplets_fetch_them(
    agl_server: AglServerProcess,
) -> None:
    hooks = RouteSeeingHooks()
    config = dataclasses.replace(FAST, include_routed_experts=True)
    with (
        AglClient(agl_server.url, TEST_KEY) as client,
        FakeAgents(agl_server.url, behaviour=AgentBehaviour(routed_experts=True)) as agents,
    ):
        completed = (
            SyncRolloutManager(client, config, hooks=hooks)
            .enqueue_and_wait_until_completed([{"x": 0}], is_train=True)
            .completed
        )
    assert agents.stats.errors == []
    assert hooks.routes == ["absent", "absent"]
    assert [t.routed_experts for r in completed for t in r.triplets] == ["routes-0", "routes-0"]


def test_each_rollout_is_hooked_exactly_once(agl_server: AglServerProcess) -> None:
    hooks = RecordingHooks()
    behaviour = lambda r: AgentBehaviour(outcome="failed" if r["input"]["x"] else "succeeded")  # noqa: E731
    completed = _run(agl_server, hooks, behaviour)
    finished = sorted(rid for kind, rid in hooks.calls if kind != "enqueue")
    assert finished == sorted(r.rollout_id for r in completed)
    assert Counter(r.final_reward for r in completed) == {-1.0: 2, 5.0: 2}


class RaisingHooks(RolloutHooks):
    def on_enqueue(self, request: RolloutCreate) -> RolloutCreate:
        raise RuntimeError("enqueue boom")

    def on_succeeded(self, rollout: Rollout, events: dict[str, list[Event]], store: TraceWriter) -> None:
        store.add_event(rollout.rollout_id, rollout.visible_attempt_id, "reward", {"value": 9.0})
        raise RuntimeError("succeeded boom")


def test_a_raising_hook_is_logged_with_traceback_and_never_stops_the_wait(
    agl_server: AglServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="agl_rollout.hooks"):
        result = _wait(agl_server, RaisingHooks(), AgentBehaviour(reward=1.0))
    completed = result.completed
    assert [r.final_reward for r in completed] == [1.0] * 4  # the buffered reward was never flushed
    assert all(set(r.input) == {"x"} for r in completed)
    tracebacks = [rec for rec in caplog.records if rec.exc_info is not None]
    assert {str(rec.exc_info[1]) for rec in tracebacks if rec.exc_info} == {"enqueue boom", "succeeded boom"}
    assert len(tracebacks) == 8
    assert result.metrics["training/n_hook_errors"] == 8.0
