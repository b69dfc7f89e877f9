"""The fully-async collector against the real server: overlap, the admission bound, the staleness
gate (drop and requeue, exact counts), a failing thread, and exact-once resume from its state.

The tests that judge staleness send their agents' calls through the real gateway, which records
each call's weight version from the registration that served it; the test moves the registration
as the trainer's publisher does (:func:`_publish`). No agent writes its own version."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agl_rollout import (
    Admission,
    AglClient,
    AsyncRolloutManager,
    AsyncRolloutState,
    CollectorError,
    GroupCollector,
    RetryPolicy,
    RolloutHooks,
    RolloutManagerConfig,
    StalenessGate,
    model_registrations,
)
from agl_testing.agents import AgentBehaviour, FakeAgents
from agl_testing.agl_server import TEST_KEY, TEST_MODEL_NAME, AglServerProcess
from agl_testing.collector import wait_complete, wait_polls
from agl_testing.fake_upstream import HeldCompletions
from agl_types import RolloutState

pytestmark = [pytest.mark.server, pytest.mark.timeout(120)]

N = 2
B = 2
CONFIG = RolloutManagerConfig(train_rollout_n=N, poll_interval_seconds=0.02, rollout_timeout_seconds=60.0)
TAKE_TIMEOUT_S = 60.0


class Samples:
    """An endless numbered stream of samples ``{"x": i}``; remembers how many were handed out."""

    def __init__(self) -> None:
        self._counter: Iterator[int] = itertools.count()
        self.handed_out: list[int] = []

    def __call__(self, k: int) -> list[dict[str, Any]]:
        xs = [next(self._counter) for _ in range(k)]
        self.handed_out += xs
        return [{"x": x} for x in xs]


def _manager(
    client: AglClient, *, max_groups: int = 8, state: AsyncRolloutState | None = None
) -> AsyncRolloutManager:
    return AsyncRolloutManager(
        client, CONFIG, train_batch_size=B, async_train_batch_size=max_groups, state=state
    )


def _xs(groups: Any) -> list[int]:
    return sorted({rollout.input["x"] for group in groups for rollout in group.completed})


def _n_created(client: AglClient) -> int:
    """Rollouts the server holds in any state (finished ones are deleted when harvested)."""
    states = [RolloutState.QUEUING, RolloutState.RUNNING, RolloutState.SUCCEEDED, RolloutState.FAILED]
    return len(client.list_rollouts(states, limit=1000))


@pytest.fixture
def upstream() -> Iterator[HeldCompletions]:
    """The inference server the gateway routes the agents' calls to (a stand-in that answers at once)."""
    with HeldCompletions(echo=True) as server:
        yield server


def _publish(client: AglClient, upstream: HeldCompletions, version: int) -> None:
    """Serve ``version`` through the gateway, as the publisher does: register it, open the gateway."""
    client.register_models(
        model_registrations(TEST_MODEL_NAME, [f"http://{upstream.address}/v1"], version=version)
    )
    client.resume()


def _through_gateway(rollout: dict[str, Any]) -> AgentBehaviour:
    return AgentBehaviour(via_gateway=True)


def _runs_after(event: threading.Event, *, unless: set[int]) -> Callable[[dict[str, Any]], AgentBehaviour]:
    """Agents calling through the gateway; those of samples not in ``unless`` first wait for ``event``."""
    return lambda r: AgentBehaviour(wait_for=None if r["input"]["x"] in unless else event, via_gateway=True)


def test_groups_keep_completing_while_a_taken_step_trains(
    fresh_agl_server: AglServerProcess, upstream: HeldCompletions
) -> None:
    samples = Samples()
    # Samples 2 and 3 finish only once the first step is taken, so that step takes 0 and 1 (with
    # instant agents any two complete groups could come first: 0 and 2 were seen in CI, seed 8686).
    first_taken = threading.Event()
    later = _runs_after(first_taken, unless={0, 1})
    with (
        AglClient(fresh_agl_server.url, TEST_KEY) as client,
        FakeAgents(fresh_agl_server.url, behaviour=later),
        GroupCollector(_manager(client, max_groups=4), samples, StalenessGate(max_staleness=1)) as collector,
    ):
        _publish(client, upstream, 0)
        # With K=1, (K + 1) * B groups start before the first step: one step's worth runs ahead.
        first = collector.take(trained_version=0, timeout_s=TAKE_TIMEOUT_S)
        first_taken.set()
        # While the taken step trains (step_done not yet called) the other B groups complete.
        wait_complete(collector, B, timeout_s=TAKE_TIMEOUT_S)
        assert collector.n_complete == B
        assert samples.handed_out == [0, 1, 2, 3]  # and no more start: K * B are already held
        _publish(client, upstream, 1)
        collector.step_done()
        second = collector.take(trained_version=1, timeout_s=TAKE_TIMEOUT_S)
        # The gateway recorded their calls at version 0; they train against version 1: one version stale.
        assert second.metrics["training/async/staleness_max"] == 1.0
        wait_polls(collector, 1, timeout_s=TAKE_TIMEOUT_S)
        assert samples.handed_out == [0, 1, 2, 3, 4, 5]  # published: the next step's B may start
    assert _xs(first.groups) == [0, 1]
    assert _xs(second.groups) == [2, 3]


def test_bound_zero_starts_no_group_before_the_taken_step_is_published(
    fresh_agl_server: AglServerProcess, upstream: HeldCompletions
) -> None:
    samples = Samples()
    with (
        AglClient(fresh_agl_server.url, TEST_KEY) as client,
        FakeAgents(fresh_agl_server.url, behaviour=_through_gateway),
        GroupCollector(_manager(client), samples, StalenessGate(max_staleness=0)) as collector,
    ):
        _publish(client, upstream, 0)
        collector.take(trained_version=0, timeout_s=TAKE_TIMEOUT_S)
        wait_polls(collector, 5, timeout_s=TAKE_TIMEOUT_S)
        assert samples.handed_out == [0, 1]
        assert _n_created(client) == 0
        _publish(client, upstream, 1)
        collector.step_done()
        collector.take(trained_version=1, timeout_s=TAKE_TIMEOUT_S)
        assert samples.handed_out == [0, 1, 2, 3]


def test_over_age_groups_are_dropped_and_counted(
    fresh_agl_server: AglServerProcess, upstream: HeldCompletions
) -> None:
    samples = Samples()
    # Sample 0 runs while version 0 is served; the others once version 3 is: at trained version 3
    # with K=1, sample 0 (age 3) is dropped; samples 1 and 2 (age 0) are trained.
    v3_served = threading.Event()
    behaviour = _runs_after(v3_served, unless={0})
    with (
        AglClient(fresh_agl_server.url, TEST_KEY) as client,
        FakeAgents(fresh_agl_server.url, behaviour=behaviour),
        GroupCollector(_manager(client, max_groups=3), samples, StalenessGate(max_staleness=1)) as collector,
    ):
        _publish(client, upstream, 0)
        wait_complete(collector, 1, timeout_s=TAKE_TIMEOUT_S)
        _publish(client, upstream, 3)
        v3_served.set()
        wait_complete(collector, 3, timeout_s=TAKE_TIMEOUT_S)
        assert collector.n_complete == 3
        taken = collector.take(trained_version=3, timeout_s=TAKE_TIMEOUT_S)
    assert _xs(taken.groups) == [1, 2]
    assert taken.metrics["training/async/dropped_stale"] == 1.0
    assert taken.metrics["training/async/requeued_stale"] == 0.0
    assert taken.metrics["training/async/staleness_max"] == 0.0


def test_over_age_groups_are_requeued_as_fresh_groups_of_the_same_sample(
    fresh_agl_server: AglServerProcess, upstream: HeldCompletions
) -> None:
    samples = Samples()
    runs_of_sample_0 = 0
    lock = threading.Lock()
    v3_served = threading.Event()

    def behaviour(rollout: dict[str, Any]) -> AgentBehaviour:
        # Sample 0's first group runs while version 0 is served; everything else (its requeued group
        # too) once version 3 is.
        nonlocal runs_of_sample_0
        if rollout["input"]["x"] != 0:
            return AgentBehaviour(wait_for=v3_served, via_gateway=True)
        with lock:
            runs_of_sample_0 += 1
            return AgentBehaviour(wait_for=None if runs_of_sample_0 <= N else v3_served, via_gateway=True)

    trained: list[int] = []
    requeued = 0.0
    with (
        AglClient(fresh_agl_server.url, TEST_KEY) as client,
        FakeAgents(fresh_agl_server.url, behaviour=behaviour),
        GroupCollector(
            _manager(client, max_groups=3), samples, StalenessGate(max_staleness=1, strategy="requeue")
        ) as collector,
    ):
        _publish(client, upstream, 0)
        wait_complete(collector, 1, timeout_s=TAKE_TIMEOUT_S)
        _publish(client, upstream, 3)
        v3_served.set()
        wait_complete(collector, 3, timeout_s=TAKE_TIMEOUT_S)
        assert collector.n_complete == 3
        while 0 not in trained:
            taken = collector.take(trained_version=3, timeout_s=TAKE_TIMEOUT_S)
            assert taken.metrics["training/async/dropped_stale"] == 0.0
            assert taken.metrics["training/async/staleness_max"] == 0.0
            requeued += taken.metrics["training/async/requeued_stale"]
            trained += _xs(taken.groups)
            collector.step_done()
    assert requeued == 1.0
    assert runs_of_sample_0 == 2 * N  # its first group, then the requeued one: the same sample again
    assert len(trained) == len(set(trained))


def test_a_failing_collector_thread_fails_take_with_its_cause(fresh_agl_server: AglServerProcess) -> None:
    def broken(k: int) -> list[dict[str, Any]]:
        raise ValueError("the dataset is broken")

    with (
        AglClient(fresh_agl_server.url, TEST_KEY) as client,
        GroupCollector(_manager(client), broken, StalenessGate(max_staleness=1)) as collector,
        pytest.raises(CollectorError, match="the dataset is broken") as raised,
    ):
        collector.take(trained_version=0, timeout_s=TAKE_TIMEOUT_S)
    assert isinstance(raised.value.__cause__, ValueError)


def test_resume_from_the_collectors_state_trains_every_group_exactly_once(
    fresh_agl_server: AglServerProcess,
) -> None:
    samples = Samples()
    # Samples 2 and 3 wait for the first run to stop after one step, so they are still running then.
    first_stopped = threading.Event()
    slow = lambda r: AgentBehaviour(wait_for=first_stopped if r["input"]["x"] in (2, 3) else None)  # noqa: E731
    trained: list[int] = []
    with (
        AglClient(fresh_agl_server.url, TEST_KEY) as client,
        FakeAgents(fresh_agl_server.url, behaviour=slow),
    ):
        with GroupCollector(
            _manager(client, max_groups=4), samples, StalenessGate(max_staleness=None)
        ) as first:
            trained += _xs(first.take(trained_version=0, timeout_s=TAKE_TIMEOUT_S).groups)
            first.step_done()
            wait_polls(first, 1, timeout_s=TAKE_TIMEOUT_S)
            state = first.state
        first_stopped.set()
        carried = {r.input["x"] for g in state.groups for r in [*g.pending.values(), *g.completed]}
        assert {2, 3} <= carried  # the slow samples were still running at the stop
        assert carried.isdisjoint(trained)
        resumed = GroupCollector(
            _manager(client, max_groups=4, state=state),
            samples,
            StalenessGate(max_staleness=None),
            steps_done=1,
        )
        deadline = time.monotonic() + TAKE_TIMEOUT_S
        with resumed:
            while not carried <= set(trained):
                assert time.monotonic() < deadline, f"carried samples {carried - set(trained)} never trained"
                trained += _xs(resumed.take(trained_version=1, timeout_s=TAKE_TIMEOUT_S).groups)
                resumed.step_done()
    # The carried groups are trained after the resume; no sample is trained twice or lost.
    assert carried <= set(trained)
    assert len(trained) == len(set(trained))
    assert {0, 1, 2, 3} <= set(trained)


def test_groups_served_by_weights_newer_than_the_trained_ones_are_dropped_counted_and_their_sample_run_again(
    fresh_agl_server: AglServerProcess, upstream: HeldCompletions
) -> None:
    # Sample 0 runs while the gateway serves version 5 (a dead run's last publish, which a resumed
    # run finds registered), the others once the run has published its own version 0 again. The
    # dropped group's sample is run again at version 0: it is trained once, not lost.
    samples = Samples()
    v0_served = threading.Event()
    runs_after = _runs_after(v0_served, unless={0})
    runs_of_sample_0: list[str] = []

    def behaviour(rollout: dict[str, Any]) -> AgentBehaviour:
        if rollout["input"]["x"] == 0:
            runs_of_sample_0.append(rollout["rollout_id"])
        return runs_after(rollout)

    with (
        AglClient(fresh_agl_server.url, TEST_KEY) as client,
        FakeAgents(fresh_agl_server.url, behaviour=behaviour),
        GroupCollector(
            _manager(client, max_groups=3), samples, StalenessGate(max_staleness=None)
        ) as collector,
    ):
        _publish(client, upstream, 5)
        wait_complete(collector, 1, timeout_s=TAKE_TIMEOUT_S)
        _publish(client, upstream, 0)
        v0_served.set()
        wait_complete(collector, 3, timeout_s=TAKE_TIMEOUT_S)
        first = collector.take(trained_version=0, timeout_s=TAKE_TIMEOUT_S)
        collector.step_done()
        trained = _xs(first.groups)
        while 0 not in trained:
            trained += _xs(collector.take(trained_version=0, timeout_s=TAKE_TIMEOUT_S).groups)
            collector.step_done()
    assert _xs(first.groups) == [1, 2]
    assert first.metrics["training/async/dropped_future_version"] == 1.0
    assert first.metrics["training/async/dropped_stale"] == 0.0
    assert len(trained) == len(set(trained))
    assert len(runs_of_sample_0) == 2 * N  # its group at version 5, then a fresh one at version 0


def test_a_slow_hook_does_not_block_take(fresh_agl_server: AglServerProcess) -> None:
    later, in_hook, hook_released = threading.Event(), threading.Event(), threading.Event()

    class SlowHooks(RolloutHooks):
        def on_succeeded(self, rollout: Any, events: Any, store: Any) -> None:
            if rollout.input["x"] >= B:
                in_hook.set()
                hook_released.wait(TAKE_TIMEOUT_S)

    # Samples 0 and 1 finish first; the thread then sits in the hook of sample 2 or 3.
    behaviour = lambda r: AgentBehaviour(wait_for=later if r["input"]["x"] >= B else None)  # noqa: E731
    manager = AsyncRolloutManager(
        AglClient(fresh_agl_server.url, TEST_KEY),
        CONFIG,
        train_batch_size=B,
        async_train_batch_size=4,
        hooks=SlowHooks(),
    )
    try:
        with (
            FakeAgents(fresh_agl_server.url, behaviour=behaviour),
            GroupCollector(manager, Samples(), StalenessGate(max_staleness=1)) as collector,
        ):
            wait_complete(collector, B, timeout_s=TAKE_TIMEOUT_S)
            later.set()
            assert in_hook.wait(TAKE_TIMEOUT_S)
            taken = collector.take(trained_version=0, timeout_s=TAKE_TIMEOUT_S)
            assert not hook_released.is_set()  # the take returned while the hook still ran
            hook_released.set()
    finally:
        hook_released.set()
        manager.client.close()
    assert _xs(taken.groups) == [0, 1]


def test_stop_with_cancel_leaves_no_rollout_queued_or_running(fresh_agl_server: AglServerProcess) -> None:
    never = threading.Event()
    samples = Samples()
    try:
        with (
            AglClient(fresh_agl_server.url, TEST_KEY) as client,
            FakeAgents(fresh_agl_server.url, behaviour=AgentBehaviour(wait_for=never)),
        ):
            collector = GroupCollector(
                _manager(client, max_groups=4), samples, StalenessGate(max_staleness=1)
            )
            collector.start()
            wait_polls(collector, 2, timeout_s=TAKE_TIMEOUT_S)
            cancelled = collector.stop(cancel=True)
            assert _n_created(client) == 0
            state = collector.state
    finally:
        never.set()
    assert cancelled == 4 * N == len(samples.handed_out) * N
    # The checkpoint's copy still holds the groups: a resume re-creates them.
    assert sum(len(group.pending) for group in state.groups) == 4 * N


def test_stop_with_cancel_after_the_server_died_ends_the_clean_up_with_one_warning(
    fresh_agl_server: AglServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    # No agent runs: the rollouts stay queued, pending for the collector.
    with AglClient(fresh_agl_server.url, TEST_KEY) as client:
        collector = GroupCollector(_manager(client, max_groups=4), Samples(), StalenessGate(max_staleness=1))
        collector.start()
        wait_polls(collector, 2, timeout_s=TAKE_TIMEOUT_S)
        fresh_agl_server.stop()
        client.retry = RetryPolicy(max_attempts=1)
        with caplog.at_level(logging.WARNING, logger="agl_rollout"):
            cancelled = collector.stop(cancel=True)
    assert cancelled == 0
    cancel_lines = [r.getMessage() for r in caplog.records if "not cancelled" in r.getMessage()]
    assert [line.split(":", 1)[0] for line in cancel_lines] == [f"{4 * N} pending rollouts not cancelled"]
    assert not [r for r in caplog.records if "could not delete" in r.getMessage()]


def test_groups_the_keep_filter_refuses_free_their_place_for_new_samples(
    fresh_agl_server: AglServerProcess,
) -> None:
    samples = Samples()
    odd = lambda group: group.completed[0].input["x"] % 2 == 1  # noqa: E731
    with (
        AglClient(fresh_agl_server.url, TEST_KEY) as client,
        FakeAgents(fresh_agl_server.url),
        # K=0 admits one step's B groups: the step fills only as filtered groups are replaced.
        GroupCollector(_manager(client), samples, StalenessGate(max_staleness=0)) as collector,
    ):
        taken = collector.take(trained_version=0, timeout_s=TAKE_TIMEOUT_S, keep=odd)
    assert _xs(taken.groups) == [1, 3]
    assert (taken.n_examined, taken.n_filtered, taken.short) == (4, 2, False)


def test_a_take_stops_at_max_examined_and_says_it_is_short(fresh_agl_server: AglServerProcess) -> None:
    with (
        AglClient(fresh_agl_server.url, TEST_KEY) as client,
        FakeAgents(fresh_agl_server.url),
        GroupCollector(_manager(client), Samples(), StalenessGate(max_staleness=0)) as collector,
    ):
        taken = collector.take(
            trained_version=0, timeout_s=TAKE_TIMEOUT_S, keep=lambda g: False, max_examined=3
        )
    assert (taken.groups, taken.n_examined, taken.n_filtered, taken.short) == ([], 3, 3, True)


def test_groups_a_waiting_take_has_kept_still_count_against_admission(
    fresh_agl_server: AglServerProcess,
) -> None:
    samples = Samples()
    release = threading.Event()
    behaviour = lambda r: AgentBehaviour(wait_for=release if r["input"]["x"] == 1 else None)  # noqa: E731
    sync = Admission(B, B, 0, overlap=False)
    taken: list[Any] = []
    with (
        AglClient(fresh_agl_server.url, TEST_KEY) as client,
        FakeAgents(fresh_agl_server.url, behaviour=behaviour),
        GroupCollector(_manager(client), samples, StalenessGate(0), admission=sync) as collector,
    ):
        wait_complete(collector, 1, timeout_s=TAKE_TIMEOUT_S)
        taker = threading.Thread(target=lambda: taken.append(collector.take(0, timeout_s=TAKE_TIMEOUT_S)))
        taker.start()
        wait_polls(collector, 3, timeout_s=TAKE_TIMEOUT_S)  # the take holds group 0 and waits for 1
        assert samples.handed_out == [0, 1]
        release.set()
        taker.join(TAKE_TIMEOUT_S)
        wait_polls(collector, 3, timeout_s=TAKE_TIMEOUT_S)
        assert samples.handed_out == [0, 1]  # sync: nothing starts while the taken step trains
    assert _xs(taken[0].groups) == [0, 1]
