"""Specified behaviours of the carry-over collector and of the gateway drain, against the real agl-server.

Requests are counted by a FaultProxy that injects nothing: it only relays and logs them.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import httpx
import pytest

from agl_rollout import (
    Admission,
    AglClient,
    AsyncRolloutManager,
    GroupCollector,
    RolloutHooks,
    RolloutManagerConfig,
    StalenessGate,
    SyncRolloutManager,
    TraceWriter,
    model_registrations,
    pause_and_drain,
)
from agl_testing.agents import AgentBehaviour, FakeAgents
from agl_testing.agl_server import TEST_KEY, TEST_MODEL_NAME, AglServerProcess
from agl_testing.fake_upstream import HeldCompletions
from agl_testing.fault_proxy import FaultProxy
from agl_testing.waiting import wait_until
from agl_types import Event, Rollout, RolloutCreate, RolloutState

pytestmark = [pytest.mark.server, pytest.mark.timeout(120)]  # a hang fails in minutes, not CI's 1200 s

N = 2


class CountingHooks(RolloutHooks):
    def __init__(self) -> None:
        self.hooked: Counter[str] = Counter()

    def on_succeeded(self, rollout: Rollout, events: dict[str, list[Event]], store: TraceWriter) -> None:
        self.hooked[rollout.rollout_id] += 1

    def on_failed(self, rollout: Rollout, events: dict[str, list[Event]], store: TraceWriter) -> None:
        self.hooked[rollout.rollout_id] += 1


class TimeoutSignal(RolloutHooks):
    """Sets ``x0_timed_out`` when the trainer times x=0's rollout out (its ``on_failed`` hook)."""

    def __init__(self) -> None:
        self.x0_timed_out = threading.Event()

    def on_failed(self, rollout: Rollout, events: dict[str, list[Event]], store: TraceWriter) -> None:
        if rollout.input["x"] == 0:
            self.x0_timed_out.set()


def _second_of_x0(behaviour: AgentBehaviour) -> Any:
    """x=0's second rollout to be claimed does ``behaviour``; every other one succeeds at once."""
    seen: Counter[int] = Counter()

    def pick(rollout: dict[str, Any]) -> AgentBehaviour:
        x = int(rollout["input"]["x"])
        seen[x] += 1  # called on the one dispatcher thread
        return behaviour if (x, seen[x]) == (0, 2) else AgentBehaviour()

    return pick


class Finite:
    """The samples ``{"x": i}`` for i in ``xs``, as many as asked for until none is left."""

    def __init__(self, *xs: int) -> None:
        self._left = list(xs)

    def __call__(self, k: int) -> list[dict[str, Any]]:
        taken, self._left = self._left[:k], self._left[k:]
        return [{"x": x} for x in taken]


def _carry_over(
    client: AglClient,
    config: RolloutManagerConfig,
    samples: Finite,
    hooks: RolloutHooks,
    *,
    per_step: int,
    held: int,
) -> GroupCollector:
    """The collector of the trainer's carry-over async mode (``--async``)."""
    manager = AsyncRolloutManager(
        client, config, train_batch_size=per_step, async_train_batch_size=held, hooks=hooks
    )
    return GroupCollector(
        manager, samples, StalenessGate(None), admission=Admission.carry_over(per_step, held)
    )


def test_finished_members_of_an_unfinished_async_group_are_never_polled_or_hooked_again(
    fresh_agl_server: AglServerProcess,
) -> None:
    config = RolloutManagerConfig(train_rollout_n=N, poll_interval_seconds=0.02, rollout_timeout_seconds=60)
    hooks = CountingHooks()
    second_may_finish = threading.Event()
    with (
        FaultProxy(fresh_agl_server.port) as proxy,
        AglClient(proxy.url, TEST_KEY) as client,
        FakeAgents(fresh_agl_server.url, behaviour=_second_of_x0(AgentBehaviour(wait_for=second_may_finish))),
        _carry_over(client, config, Finite(0, 1), hooks, per_step=1, held=2) as collector,
    ):
        step1 = collector.take(0, timeout_s=60)
        [carried] = collector.state.groups
        [finished] = [r.rollout_id for r in carried.completed]
        n_requests_at_step1 = len(proxy.requests)
        second_may_finish.set()
        collector.step_done()
        step2 = collector.take(1, timeout_s=60)
    assert [r.input["x"] for r in step1.rollouts] == [1, 1]
    assert [r.input["x"] for r in step2.rollouts] == [0, 0]
    assert finished in {r.rollout_id for r in step2.rollouts}
    assert any(finished in path for _, path in proxy.requests[:n_requests_at_step1])  # it was polled once
    assert [path for _, path in proxy.requests[n_requests_at_step1:] if finished in path] == []
    assert sorted(hooks.hooked.values()) == [1, 1, 1, 1]


def test_a_rollout_past_its_timeout_in_async_mode_completes_its_group_as_timed_out(
    fresh_agl_server: AglServerProcess,
) -> None:
    config = RolloutManagerConfig(train_rollout_n=N, poll_interval_seconds=0.05, rollout_timeout_seconds=1.0)
    hooks = TimeoutSignal()

    def behaviour(rollout: dict[str, Any]) -> AgentBehaviour:
        if rollout["input"]["x"] in (3, 4):  # step 2's samples finish only after x=0 completed
            return AgentBehaviour(wait_for=hooks.x0_timed_out)
        return stuck_x0(rollout)

    stuck_x0 = _second_of_x0(AgentBehaviour(outcome="never_finish"))
    with (
        AglClient(fresh_agl_server.url, TEST_KEY) as client,
        FakeAgents(fresh_agl_server.url, behaviour=behaviour),
        _carry_over(client, config, Finite(0, 1, 2, 3, 4), hooks, per_step=2, held=3) as collector,
    ):
        step1 = collector.take(0, timeout_s=60)
        collector.step_done()  # admits x=3 and x=4 in the places x=1 and x=2 freed
        # x=0 completes when its stuck member times out, before x=3 and x=4, so it is the oldest
        # complete group the next step takes.
        step2 = collector.take(1, timeout_s=60)
        left = client.list_rollouts(list(RolloutState))
    assert sorted(r.input["x"] for r in step1.rollouts) == [1, 1, 2, 2]
    x0 = [r for r in step2.rollouts if r.input["x"] == 0]
    assert sorted((r.timed_out, r.rollout_state, r.error_message) for r in x0) == [
        (False, RolloutState.SUCCEEDED, None),
        (True, RolloutState.FAILED, "timed out by trainer after 1 s"),
    ]
    timed_out = [s.metrics["training/n_rollouts_timed_out"] for s in (step1, step2)]
    assert sum(timed_out) == 1.0
    assert x0[1].rollout_id not in {r.rollout_id for r in left}  # failed and deleted on the server


def test_the_drain_polls_the_gateway_at_the_configured_interval_until_the_call_in_flight_ends(
    fresh_agl_server: AglServerProcess,
) -> None:
    def paused() -> bool:
        with AglClient(fresh_agl_server.url, TEST_KEY) as direct:
            return direct.proxy_state().paused

    hold_s, interval_s = 2.0, 1.0
    with (
        HeldCompletions(paused, hold_after_s=hold_s) as upstream,
        FaultProxy(fresh_agl_server.port) as proxy,
        AglClient(proxy.url, TEST_KEY) as client,
    ):
        client.register_models(model_registrations(TEST_MODEL_NAME, [upstream.address], version=0))
        [rollout] = client.create_rollouts([RolloutCreate(input=None, rollout_id="held")])
        url = f"{fresh_agl_server.url}/proxy/rollout/{rollout.rollout_id}/attempt/0/mode/train/openai/v1/completions"
        call = threading.Thread(
            target=httpx.post,
            args=(url,),
            kwargs={
                "json": {"prompt": "hi"},
                "headers": {"Authorization": f"Bearer {TEST_KEY}"},
                "timeout": 60,
            },
        )
        call.start()
        assert upstream.received.wait(30), "the call never reached the upstream"
        before = len(proxy.requests)
        metrics = pause_and_drain(client, "drain", poll_interval=interval_s, timeout_s=30)
        returned_at = time.monotonic()
        polls = [r for r in proxy.requests[before:] if r == ("GET", "/proxy/state")]
        call.join(timeout=30)
        client.resume()
    assert metrics["training/async/proxy_inflight_at_pause"] == 1.0
    [answered_at] = upstream.answered_at
    assert answered_at <= returned_at
    # The call was held hold_s after the pause: polls every interval_s make hold_s / interval_s
    # of them, one more if the answer lands just after a poll (a loaded machine only makes fewer);
    # the default interval (0.25 s) would make 8.
    assert 1 <= len(polls) <= round(hold_s / interval_s) + 1


def _listings_after(proxy: FaultProxy, index: int) -> list[int]:
    """Indexes of the rollout listings the proxy relayed from ``index`` on."""
    return [
        i
        for i, (_, path) in enumerate(proxy.requests[index:], start=index)
        if path.startswith("/api/rollouts?")
    ]


def test_a_sweep_whose_listing_shows_one_of_ours_running_gets_no_single_rollout(
    fresh_agl_server: AglServerProcess,
) -> None:
    """While one rollout runs and one still queues, every sweep lists RUNNING rollouts for the
    queued one's start time; that listing already shows the server holds ours, so no sweep also
    GETs a pending rollout to check."""
    config = RolloutManagerConfig(poll_interval_seconds=0.02, rollout_timeout_seconds=3)
    may_finish = threading.Event()

    def behaviour(rollout: dict[str, Any]) -> AgentBehaviour:
        if rollout["input"]["x"] == 0:
            return AgentBehaviour(wait_for=may_finish)
        return AgentBehaviour(outcome="never_start")

    with (
        FaultProxy(fresh_agl_server.port) as proxy,
        AglClient(proxy.url, TEST_KEY) as client,
        AglClient(fresh_agl_server.url, TEST_KEY) as observer,
        FakeAgents(fresh_agl_server.url, behaviour=behaviour),
    ):
        waiting = threading.Thread(
            target=SyncRolloutManager(client, config).enqueue_and_wait_until_completed,
            args=([{"x": 0}, {"x": 1}],),
            kwargs={"is_train": True},
        )
        waiting.start()
        wait_until(lambda: bool(observer.list_rollouts([RolloutState.RUNNING])), "x=0 running", timeout_s=30)
        running_seen = len(proxy.requests)
        # From the first listing sent after that, every listing shows x=0 running.
        wait_until(
            lambda: _listings_after(proxy, running_seen) != [], "a listing after x=0 ran", timeout_s=30
        )
        start = _listings_after(proxy, running_seen)[0] + 1
        wait_until(lambda: len(_listings_after(proxy, start)) >= 3, "three more sweeps", timeout_s=30)
        window = proxy.requests[start:]
        may_finish.set()
        waiting.join(timeout=30)
    paths = Counter(path.split("?")[0] for _, path in window)
    assert min(paths["/api/rollouts/terminal"], paths["/api/rollouts"]) >= 3  # sweeps, each with a listing
    assert set(paths) == {"/api/rollouts/terminal", "/api/rollouts"}  # and no GET of one rollout
