"""Carry-over async through the collector against the real server: group waits, carry-over, the
refill of freed places, resume against a restarted server, loss during a wait.

Every test drives :class:`GroupCollector` with the carry-over admission, as the trainer's
``--async`` mode does: groups are admitted between steps only, and a step's take hands over the
oldest complete ones."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from agl_rollout import (
    Admission,
    AglClient,
    AsyncRolloutManager,
    AsyncRolloutState,
    CollectedGroups,
    GroupCollector,
    RolloutHooks,
    RolloutManagerConfig,
    StalenessGate,
    TraceWriter,
)
from agl_testing.agents import AgentBehaviour, FakeAgents
from agl_testing.agl_server import TEST_KEY, AglServerProcess, restart_once_it_holds_a_rollout
from agl_testing.collector import wait_polls
from agl_types import CompletedRollout, Event, Rollout, RolloutState

pytestmark = [pytest.mark.server, pytest.mark.timeout(120)]  # a hang fails in minutes, not CI's 1200 s

N = 2
CONFIG = RolloutManagerConfig(train_rollout_n=N, poll_interval_seconds=0.02, rollout_timeout_seconds=30.0)
TAKE_TIMEOUT_S = 60.0


class CountingHooks(RolloutHooks):
    def __init__(self) -> None:
        self.finished: Counter[str] = Counter()

    def on_succeeded(self, rollout: Rollout, events: dict[str, list[Event]], store: TraceWriter) -> None:
        self.finished[rollout.rollout_id] += 1


class Samples:
    """An endless numbered stream of samples ``{"x": i}`` from ``first``; remembers which were handed out."""

    def __init__(self, first: int = 0) -> None:
        self._next = first
        self.handed_out: list[int] = []

    def __call__(self, k: int) -> list[dict[str, Any]]:
        xs = list(range(self._next, self._next + k))
        self._next += k
        self.handed_out += xs
        return [{"x": x} for x in xs]


def _carry_over(
    client: AglClient,
    samples: Callable[[int], list[dict[str, Any]]],
    *,
    per_step: int,
    max_groups: int,
    hooks: RolloutHooks | None = None,
    state: AsyncRolloutState | None = None,
    steps_done: int = 0,
    config: RolloutManagerConfig = CONFIG,
) -> GroupCollector:
    manager = AsyncRolloutManager(
        client, config, train_batch_size=per_step, async_train_batch_size=max_groups, hooks=hooks, state=state
    )
    return GroupCollector(
        manager,
        samples,
        StalenessGate(None),
        admission=Admission.carry_over(per_step, max_groups),
        steps_done=steps_done,
    )


def _step(collector: GroupCollector, *, done: bool = True) -> CollectedGroups:
    """One step: take its groups and (``done``) end it, so the freed places are refilled."""
    taken = collector.take(0, timeout_s=TAKE_TIMEOUT_S)
    if done:
        collector.step_done()
    return taken


def _groups(completed: list[CompletedRollout]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for r in completed:
        groups.setdefault(r.data_id, []).append(r.input["x"])
    return groups


def _x0_waits_for(release: threading.Event) -> Callable[[dict[str, Any]], AgentBehaviour]:
    """x=0's rollouts stay RUNNING until the test sets ``release``; every other finishes at once."""
    return lambda r: AgentBehaviour(wait_for=release if r["input"]["x"] == 0 else None)


def test_slow_groups_carry_over_whole_and_only_the_freed_places_are_refilled(
    fresh_agl_server: AglServerProcess,
) -> None:
    hooks = CountingHooks()
    samples = Samples()
    x0_may_finish = threading.Event()
    with (
        AglClient(fresh_agl_server.url, TEST_KEY) as client,
        FakeAgents(fresh_agl_server.url, behaviour=_x0_waits_for(x0_may_finish)) as agents,
    ):
        collector = _carry_over(client, samples, per_step=2, max_groups=4, hooks=hooks)
        with collector:
            step1 = _step(collector, done=False)
            assert samples.handed_out == [0, 1, 2, 3]
            x0_may_finish.set()
            collector.step_done()
            wait_polls(collector, 2, timeout_s=TAKE_TIMEOUT_S)  # a whole sweep since: its top-up ran
            step2 = _step(collector, done=False)
            assert samples.handed_out == [0, 1, 2, 3, 4, 5]  # step 1 freed two places, no more
            collector.step_done()
            step3 = _step(collector, done=False)
        state = collector.state
        left = client.list_rollouts(list(RolloutState), limit=1000)
    assert agents.stats.errors == []
    trained = [_groups(s.rollouts) for s in (step1, step2, step3)]
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
    # Only pending rollouts are still on the server: finished ones were deleted when harvested.
    assert len(left) == sum(len(g.pending) for g in state.groups)


def test_complete_groups_beyond_the_need_are_kept_for_the_next_step(
    fresh_agl_server: AglServerProcess,
) -> None:
    with AglClient(fresh_agl_server.url, TEST_KEY) as client, FakeAgents(fresh_agl_server.url) as agents:
        collector = _carry_over(client, Samples(), per_step=2, max_groups=4)
        with collector:
            step1 = _step(collector, done=False)
            first = set(_groups(step1.rollouts))
            state = collector.state  # no sample is admitted while the taken step trains
            collector.step_done()
            step2 = _step(collector)
    assert agents.stats.errors == []
    held = {g.data_id for g in state.groups}
    assert len(held) == 2 and not held & first
    second = set(_groups(step2.rollouts))
    assert second == held  # oldest complete groups first
    assert step2.metrics["training/async/trained_group_staleness/mean"] == 1.0


def test_resume_against_a_restarted_server_recreates_the_lost_pending_members(
    fresh_agl_server: AglServerProcess,
) -> None:
    x0_never_starts = lambda r: AgentBehaviour(outcome="never_start" if r["input"]["x"] == 0 else "succeeded")  # noqa: E731
    with AglClient(fresh_agl_server.url, TEST_KEY) as client:
        with FakeAgents(fresh_agl_server.url, behaviour=x0_never_starts) as before:
            with _carry_over(client, Samples(), per_step=2, max_groups=3) as collector:
                step1 = _step(collector, done=False)
            state = AsyncRolloutState.model_validate_json(collector.state.model_dump_json())
        fresh_agl_server.restart()
        with FakeAgents(fresh_agl_server.url) as after:
            resumed = _carry_over(client, Samples(3), per_step=2, max_groups=3, state=state, steps_done=1)
            with resumed:
                step2 = _step(resumed, done=False)
    assert before.stats.errors == [] and after.stats.errors == []
    assert sorted(xs[0] for xs in _groups(step1.rollouts).values()) == [1, 2]
    [carried] = state.groups
    trained = {r.data_id: r.input["x"] for r in step2.rollouts}
    assert trained[carried.data_id] == 0
    assert sorted(trained.values()) in ([0, 3], [0, 4])
    assert [len(xs) for xs in _groups(step2.rollouts).values()] == [N, N]
    assert step2.metrics["training/async/n_lost_rollouts_recreated"] == 2.0


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
        restarter = restart_once_it_holds_a_rollout(fresh_agl_server, restarted, lost)
        restarter.start()
        with _carry_over(client, Samples(), per_step=1, max_groups=2) as collector:
            step = _step(collector, done=False)
            restarter.join()
        carried = collector.state.groups
    [xs] = _groups(step.rollouts).values()
    assert xs in ([0] * N, [1] * N)
    assert [r.final_reward for r in step.rollouts] == [0.5] * N
    assert step.metrics["training/n_rollouts_recreated"] == 2.0 * N, "both groups' members were re-created"
    assert len(carried) == 1, "the other group is carried over with its re-created members"
    assert len(lost) == 2 * N and lost.isdisjoint(r.rollout_id for r in step.rollouts)
