"""Groups the caller names for a rerun (their rollouts failed as their inference server died) run
again as fresh groups of the same sample, counted in ``training/n_rollouts_rerun``, against the
real agl-server: every sample is trained once."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from agl_rollout import (
    AglClient,
    AsyncRolloutManager,
    CarriedGroup,
    GroupCollector,
    RolloutManagerConfig,
    StalenessGate,
)
from agl_testing.agents import AgentBehaviour, FakeAgents
from agl_testing.agl_server import TEST_KEY, AglServerProcess

pytestmark = [pytest.mark.server, pytest.mark.timeout(120)]

N = 2
B = 2
CONFIG = RolloutManagerConfig(train_rollout_n=N, poll_interval_seconds=0.02, rollout_timeout_seconds=60.0)


def _xs(groups: list[CarriedGroup]) -> list[int]:
    return sorted({rollout.input["x"] for group in groups for rollout in group.completed})


def test_groups_named_for_a_rerun_run_again_once_and_every_sample_is_trained_once(
    fresh_agl_server: AglServerProcess,
) -> None:
    counter: Iterator[int] = itertools.count()
    runs_of_sample_0: list[str] = []

    def samples(k: int) -> list[dict[str, Any]]:
        return [{"x": next(counter)} for _ in range(k)]

    def behaviour(rollout: dict[str, Any]) -> AgentBehaviour:
        if rollout["input"]["x"] != 0:
            return AgentBehaviour()
        runs_of_sample_0.append(rollout["rollout_id"])
        # Sample 0's first group fails (its server died); the rerun succeeds.
        return AgentBehaviour(outcome="failed" if len(runs_of_sample_0) <= N else "succeeded")

    named: list[str] = []

    def rerun(group: CarriedGroup) -> bool:
        failed = any(not rollout.succeeded for rollout in group.completed)
        if failed and group.data_id not in named:
            named.append(group.data_id)
            return True
        return False

    manager = AsyncRolloutManager(
        AglClient(fresh_agl_server.url, TEST_KEY), CONFIG, train_batch_size=B, async_train_batch_size=B
    )
    trained: list[int] = []
    states_of_sample_0: list[bool] = []
    reruns: list[float] = []
    try:
        with (
            FakeAgents(fresh_agl_server.url, behaviour=behaviour),
            GroupCollector(manager, samples, StalenessGate(max_staleness=0)) as collector,
        ):
            while 0 not in trained:
                taken = collector.take(trained_version=0, timeout_s=60.0, rerun=rerun)
                trained += _xs(taken.groups)
                states_of_sample_0 += [
                    r.succeeded for g in taken.groups for r in g.completed if r.input["x"] == 0
                ]
                reruns.append(taken.metrics["training/n_rollouts_rerun"])
                collector.step_done()
    finally:
        manager.client.close()
    assert len(trained) == len(set(trained))  # every sample trained once
    assert states_of_sample_0 == [True] * N  # its failed group was not trained, its rerun was
    assert len(runs_of_sample_0) == 2 * N  # its group, then a fresh one
    assert reruns[0] == float(N) and sum(reruns) == float(N)
    assert len(named) == 1
