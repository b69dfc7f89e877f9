"""Async manager against the real server: group waits, carry-over, shortfall top-up, state resume."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from agl_rollout import (
    AglClient,
    AsyncRolloutManager,
    AsyncRolloutState,
    RolloutHooks,
    RolloutManagerConfig,
    TraceWriter,
)
from agl_testing.agents import AgentBehaviour, FakeAgents
from agl_testing.agl_server import TEST_KEY, AglServerProcess, restart_once_it_holds_a_rollout
from agl_types import CompletedRollout, Event, Rollout, RolloutState

pytestmark = [pytest.mark.server, pytest.mark.timeout(120)]  # a hang fails in minutes, not CI's 1200 s

N = 2
CONFIG = RolloutManagerConfig(train_rollout_n=N, poll_interval_seconds=0.02, rollout_timeout_seconds=30.0)


class CountingHooks(RolloutHooks):
    def __init__(self) -> None:
        self.finished: Counter[str] = Counter()

    def on_succeeded(self, rollout: Rollout, events: dict[str, list[Event]], store: TraceWriter) -> None:
        self.finished[rollout.rollout_id] += 1


def _samples(start: int, n: int) -> list[dict[str, Any]]:
    return [{"x": i} for i in range(start, start + n)]


def _groups(completed: list[CompletedRollout]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for r in completed:
        groups.setdefault(r.data_id, []).append(r.input["x"])
    return groups


def _x0_waits_for(release: threading.Event) -> Callable[[dict[str, Any]], AgentBehaviour]:
    """x=0's rollouts stay RUNNING until the test sets ``release``; every other finishes at once."""
    return lambda r: AgentBehaviour(wait_for=release if r["input"]["x"] == 0 else None)


def test_slow_groups_carry_over_whole_and_shortfall_only_is_enqueued(
    fresh_agl_server: AglServerProcess,
) -> None:
    hooks = CountingHooks()
    x0_may_finish = threading.Event()
    with (
        AglClient(fresh_agl_server.url, TEST_KEY) as client,
        FakeAgents(fresh_agl_server.url, behaviour=_x0_waits_for(x0_may_finish)) as agents,
    ):
        manager = AsyncRolloutManager(
            client, CONFIG, train_batch_size=2, async_train_batch_size=4, hooks=hooks
        )
        assert manager.shortfall() == 4
        step1 = manager.enqueue_and_wait_until_group_completed(_samples(0, 4), step=1)
        x0_may_finish.set()
        shortfall = manager.shortfall()
        step2 = manager.enqueue_and_wait_until_group_completed(_samples(4, shortfall), step=2)
        step3 = manager.enqueue_and_wait_until_group_completed(_samples(10, manager.shortfall()), step=3)
        left = client.list_rollouts(list(RolloutState), limit=1000)
    assert agents.stats.errors == []
    assert shortfall == 2
    trained = [_groups(s.completed) for s in (step1, step2, step3)]
    for groups in trained:
        assert len(groups) == 2
        assert all(len(xs) == N and len(set(xs)) == 1 for xs in groups.values())
    all_x = [xs[0] for groups in trained for xs in groups.values()]
    assert len(all_x) == len(set(all_x)) == 6
    assert 0 not in [xs[0] for xs in trained[0].values()]
    assert step1.metrics["training/async/n_prev_carry_over_rollouts"] == 0.0
    assert step1.metrics["training/async/n_completed_rollouts"] == 4.0
    assert step1.metrics["training/async/n_new_carry_over_rollouts"] == 4.0
    assert step2.metrics["training/async/n_prev_carry_over_rollouts"] == 4.0
    assert step2.metrics["training/async/trained_group_staleness/max"] == 1.0
    assert max(hooks.finished.values()) == 1
    assert len(left) == manager.n_groups_held * N - sum(
        len(g.completed) for g in manager.state.groups
    )  # only pending rollouts are still on the server


def test_complete_groups_beyond_the_need_are_kept_for_the_next_step(
    fresh_agl_server: AglServerProcess,
) -> None:
    with AglClient(fresh_agl_server.url, TEST_KEY) as client, FakeAgents(fresh_agl_server.url) as agents:
        manager = AsyncRolloutManager(client, CONFIG, train_batch_size=2, async_train_batch_size=4)
        step1 = manager.enqueue_and_wait_until_group_completed(_samples(0, 4), step=1)
        first = set(_groups(step1.completed))
        state = manager.state
        step2 = manager.enqueue_and_wait_until_group_completed(_samples(4, manager.shortfall()), step=2)
    assert agents.stats.errors == []
    held = {g.data_id for g in state.groups}
    assert len(held) == 2 and not held & first
    second = set(_groups(step2.completed))
    assert second == held  # oldest complete groups first
    assert step2.metrics["training/async/trained_group_staleness/mean"] == 1.0


def test_carried_state_survives_a_json_round_trip_and_resumes(fresh_agl_server: AglServerProcess) -> None:
    x0_may_finish = threading.Event()
    with (
        AglClient(fresh_agl_server.url, TEST_KEY) as client,
        FakeAgents(fresh_agl_server.url, behaviour=_x0_waits_for(x0_may_finish)) as agents,
    ):
        manager = AsyncRolloutManager(client, CONFIG, train_batch_size=2, async_train_batch_size=4)
        step1 = manager.enqueue_and_wait_until_group_completed(_samples(0, 4), step=1)
        x0_may_finish.set()
        dumped = manager.state.model_dump_json()
        resumed = AsyncRolloutManager(
            client,
            CONFIG,
            train_batch_size=2,
            async_train_batch_size=4,
            state=AsyncRolloutState.model_validate_json(dumped),
        )
        assert resumed.shortfall() == 2
        step2 = resumed.enqueue_and_wait_until_group_completed([], step=2)
    assert agents.stats.errors == []
    trained_first = {xs[0] for xs in _groups(step1.completed).values()}
    trained_after_resume = {xs[0] for xs in _groups(step2.completed).values()}
    assert trained_after_resume == {0, 1, 2, 3} - trained_first
    assert step2.metrics["training/async/n_lost_rollouts_recreated"] == 0.0


def test_resume_against_a_restarted_server_recreates_the_lost_pending_members(
    fresh_agl_server: AglServerProcess,
) -> None:
    x0_never_starts = lambda r: AgentBehaviour(outcome="never_start" if r["input"]["x"] == 0 else "succeeded")  # noqa: E731
    with AglClient(fresh_agl_server.url, TEST_KEY) as client:
        with FakeAgents(fresh_agl_server.url, behaviour=x0_never_starts) as before:
            manager = AsyncRolloutManager(client, CONFIG, train_batch_size=2, async_train_batch_size=3)
            step1 = manager.enqueue_and_wait_until_group_completed(_samples(0, 3), step=1)
            state = manager.state
        fresh_agl_server.restart()
        with FakeAgents(fresh_agl_server.url) as after:
            resumed = AsyncRolloutManager(
                client, CONFIG, train_batch_size=2, async_train_batch_size=3, state=state
            )
            step2 = resumed.enqueue_and_wait_until_group_completed(_samples(3, resumed.shortfall()), step=2)
    assert before.stats.errors == [] and after.stats.errors == []
    assert sorted(xs[0] for xs in _groups(step1.completed).values()) == [1, 2]
    [carried] = state.groups
    trained = {r.data_id: r.input["x"] for r in step2.completed}
    assert trained[carried.data_id] == 0
    assert sorted(trained.values()) in ([0, 3], [0, 4])
    assert [len(xs) for xs in _groups(step2.completed).values()] == [N, N]
    assert step2.metrics["training/async/n_lost_rollouts_recreated"] == 2.0


def test_weight_version_span_is_recorded_per_trained_group_and_groups_without_versions_counted(
    fresh_agl_server: AglServerProcess,
) -> None:
    members_seen: Counter[int] = Counter()

    def behaviour(r: dict[str, Any]) -> AgentBehaviour:
        x = r["input"]["x"]
        members_seen[x] += 1
        if x == 0:
            return AgentBehaviour(turns=0)
        if x == 1:
            return AgentBehaviour(weight_version=2)
        if x == 2:
            return AgentBehaviour(weight_version=1 if members_seen[x] == 1 else 3)
        return AgentBehaviour(outcome="never_start")

    with (
        AglClient(fresh_agl_server.url, TEST_KEY) as client,
        FakeAgents(fresh_agl_server.url, behaviour=behaviour) as agents,
    ):
        manager = AsyncRolloutManager(client, CONFIG, train_batch_size=3, async_train_batch_size=4)
        result = manager.enqueue_and_wait_until_group_completed(_samples(0, 4), step=1)
    assert agents.stats.errors == []
    assert sorted(xs[0] for xs in _groups(result.completed).values()) == [0, 1, 2]
    assert result.metrics["training/async/trained_group_weight_version_span/mean"] == 2.0
    assert result.metrics["training/async/trained_group_weight_version_span/max"] == 3.0
    assert result.metrics["training/async/n_trained_groups_without_weight_version"] == 1.0


def test_a_step_with_fewer_groups_than_it_needs_is_refused_before_enqueueing(
    fresh_agl_server: AglServerProcess,
) -> None:
    with AglClient(fresh_agl_server.url, TEST_KEY) as client:
        manager = AsyncRolloutManager(client, CONFIG, train_batch_size=2, async_train_batch_size=4)
        with pytest.raises(
            ValueError, match="holds 0 groups and the batch adds 1, but a step needs train_batch_size=2"
        ):
            manager.enqueue_and_wait_until_group_completed(_samples(0, 1), step=1)
        left = client.list_rollouts(list(RolloutState))
        n_requests = client.request_count
    assert manager.state.groups == []
    assert left == []
    assert n_requests == 1  # the listing above: nothing was created


def test_server_restart_during_an_async_wait_recreates_the_lost_members_in_their_groups(
    fresh_agl_server: AglServerProcess,
) -> None:
    restarted, lost = threading.Event(), set[str]()
    # Every agent waits for the restart to be over, so the lost rollouts' agents fail to finish
    # them on the new server, on purpose.
    with (
        AglClient(fresh_agl_server.url, TEST_KEY) as client,
        FakeAgents(
            fresh_agl_server.url, behaviour=AgentBehaviour(reward=0.5, wait_for=restarted), check_errors=False
        ),
    ):
        manager = AsyncRolloutManager(client, CONFIG, train_batch_size=1, async_train_batch_size=2)
        restarter = restart_once_it_holds_a_rollout(fresh_agl_server, restarted, lost)
        restarter.start()
        step = manager.enqueue_and_wait_until_group_completed(_samples(0, 2), step=1)
        restarter.join()
        carried = manager.n_groups_held
    [xs] = _groups(step.completed).values()
    assert xs in ([0] * N, [1] * N)
    assert [r.final_reward for r in step.completed] == [0.5] * N
    assert step.metrics["training/n_rollouts_recreated"] == 2.0 * N, "both groups' members were re-created"
    assert carried == 1, "the other group is carried over with its re-created members"
    assert len(lost) == 2 * N and lost.isdisjoint(r.rollout_id for r in step.completed)
