"""Sync manager against the real agl-server, with fake agents playing controller and agents."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from agl_rollout import AglClient, RolloutBatchResult, RolloutManagerConfig, SyncRolloutManager
from agl_testing.agents import AgentBehaviour, FakeAgents, Outcome, TurnImage
from agl_testing.agl_server import TEST_KEY, AglServerProcess
from agl_types import RolloutState

pytestmark = [pytest.mark.server, pytest.mark.timeout(120)]  # a hang fails in minutes, not CI's 1200 s

POLL = 0.02
TIMEOUT_S = 30.0  # a stuck agent fails the test in seconds instead of hanging it


def _config(**overrides: Any) -> RolloutManagerConfig:
    return dataclasses.replace(
        RolloutManagerConfig(poll_interval_seconds=POLL, rollout_timeout_seconds=TIMEOUT_S), **overrides
    )


def _rows(n: int) -> list[dict[str, Any]]:
    return [{"x": i, "prompt": f"q{i}"} for i in range(n)]


def _server_rollouts(client: AglClient) -> list[str]:
    states = list(RolloutState)
    return [r.rollout_id for r in client.list_rollouts(states, limit=10_000)]


def _wait_train(
    agl_server: AglServerProcess,
    n: int,
    behaviour: AgentBehaviour | Callable[[dict[str, Any]], AgentBehaviour],
) -> RolloutBatchResult:
    """Enqueue ``n`` train samples, let fake agents run them with ``behaviour``, wait for all."""
    with (
        AglClient(agl_server.url, TEST_KEY) as client,
        FakeAgents(agl_server.url, behaviour=behaviour) as agents,
    ):
        result = SyncRolloutManager(client, _config()).enqueue_and_wait_until_completed(
            _rows(n), is_train=True
        )
    assert agents.stats.errors == []
    return result


def test_sync_wait_returns_every_rollout_exactly_once_and_leaves_server_empty(
    fresh_agl_server: AglServerProcess,
) -> None:
    config = _config(train_rollout_n=3)
    behaviour = lambda r: AgentBehaviour(delay_s=0.01 * (r["input"]["x"] % 4), reward=float(r["input"]["x"]))  # noqa: E731
    with (
        AglClient(fresh_agl_server.url, TEST_KEY) as client,
        FakeAgents(fresh_agl_server.url, behaviour=behaviour) as agents,
    ):
        result = SyncRolloutManager(client, config).enqueue_and_wait_until_completed(_rows(5), is_train=True)
        left = _server_rollouts(client)
    assert agents.stats.errors == []
    ids = [r.rollout_id for r in result.completed]
    assert len(ids) == 15 and len(set(ids)) == 15
    assert left == []
    by_sample = sorted((r.sample_idx_in_step, r.final_reward) for r in result.completed)
    assert by_sample == [(i, float(i)) for i in range(5) for _ in range(3)]
    assert len({r.data_id for r in result.completed}) == 5
    assert result.metrics["training/n_rollouts_succeeded"] == 15.0
    assert result.metrics["training/n_rollouts_failed"] == 0.0


def test_failed_rollouts_are_returned_with_their_error_and_counted(agl_server: AglServerProcess) -> None:
    behaviour = lambda r: AgentBehaviour(outcome="failed" if r["input"]["x"] == 0 else "succeeded")  # noqa: E731
    result = _wait_train(agl_server, 3, behaviour)
    failed = [r for r in result.completed if not r.succeeded]
    assert [(r.sample_idx_in_step, r.error_message, r.timed_out) for r in failed] == [
        (0, "fake agent failed on purpose", False)
    ]
    assert result.metrics["training/n_rollouts_failed"] == 1.0
    assert result.metrics["training/n_rollouts_succeeded"] == 2.0


def test_validation_enqueues_one_rollout_per_sample(agl_server: AglServerProcess) -> None:
    config = _config(train_rollout_n=4)
    with AglClient(agl_server.url, TEST_KEY) as client, FakeAgents(agl_server.url) as agents:
        result = SyncRolloutManager(client, config).enqueue_and_wait_until_completed(_rows(3), is_train=False)
    assert agents.stats.errors == []
    assert sorted(r.sample_idx_in_step for r in result.completed) == [0, 1, 2]


def test_multi_turn_rollout_gives_one_triplet_per_call_with_reward_on_the_last(
    agl_server: AglServerProcess,
) -> None:
    with (
        AglClient(agl_server.url, TEST_KEY) as client,
        FakeAgents(
            agl_server.url, behaviour=AgentBehaviour(turns=3, reward=0.75, weight_version=4)
        ) as agents,
    ):
        [rollout] = (
            SyncRolloutManager(client, _config())
            .enqueue_and_wait_until_completed(_rows(1), is_train=True)
            .completed
        )
    assert agents.stats.errors == []
    assert [t.reward for t in rollout.triplets] == [None, None, 0.75]
    assert [t.response_token_ids for t in rollout.triplets] == [[10, 20], [11, 21], [12, 22]]
    assert rollout.triplets[2].prompt_token_ids == [1, 2, 3, 10, 20, 30, 11, 21, 31]
    assert {t.weight_version for t in rollout.triplets} == {4}
    assert rollout.final_reward == 0.75


@pytest.mark.parametrize(
    ("include", "expected"), [(True, [None, None, "routes-2"]), (False, [None, None, None])]
)
def test_routes_come_with_the_triplets_when_asked_and_the_server_keeps_only_a_chains_last(
    agl_server: AglServerProcess, include: bool, expected: list[str | None]
) -> None:
    with (
        AglClient(agl_server.url, TEST_KEY) as client,
        FakeAgents(agl_server.url, behaviour=AgentBehaviour(turns=3, routed_experts=True)) as agents,
    ):
        [rollout] = (
            SyncRolloutManager(client, _config(include_routed_experts=include))
            .enqueue_and_wait_until_completed(_rows(1), is_train=True)
            .completed
        )
    assert agents.stats.errors == []
    assert [t.routed_experts for t in rollout.triplets] == expected


@pytest.mark.parametrize("include", [True, False])
def test_each_calls_images_come_from_its_own_raw_request_when_asked(
    agl_server: AglServerProcess, include: bool
) -> None:
    images = tuple(TurnImage(f"data:image/png;base64,dHVybi{k}") for k in range(3))
    behaviour = AgentBehaviour(turns=3, images=images, malformed=("error_status", "no_response_tokens"))
    with (
        AglClient(agl_server.url, TEST_KEY) as client,
        FakeAgents(agl_server.url, behaviour=behaviour) as agents,
    ):
        [rollout] = (
            SyncRolloutManager(client, _config(include_images=include))
            .enqueue_and_wait_until_completed(_rows(1), is_train=True)
            .completed
        )
    assert agents.stats.errors == []
    first, second, third = (image.url for image in images)
    expected = [[first], [first, second], [first, second, third]] if include else [None, None, None]
    assert [t.image_urls for t in rollout.triplets] == expected


def test_malformed_events_are_skipped_and_counted(agl_server: AglServerProcess) -> None:
    behaviour = AgentBehaviour(
        turns=2,
        reward=1.0,
        malformed=("error_status", "no_response_tokens", "bad_log_probs", "non_numeric_reward"),
    )
    result = _wait_train(agl_server, 2, behaviour)
    assert [len(r.triplets) for r in result.completed] == [2, 2]
    assert [r.final_reward for r in result.completed] == [1.0, 1.0]
    assert result.metrics["training/n_invalid_events"] == 8.0


def test_rollout_past_its_timeout_is_failed_on_server_returned_timed_out_and_counted(
    fresh_agl_server: AglServerProcess,
) -> None:
    outcomes: dict[int, Outcome] = {0: "never_finish", 1: "never_start"}
    behaviour = lambda r: AgentBehaviour(outcome=outcomes.get(r["input"]["x"], "succeeded"))  # noqa: E731
    # x=2 must finish well inside the timeout even on a loaded machine: 10x what it needs there.
    config = _config(rollout_timeout_seconds=5.0)
    with (
        AglClient(fresh_agl_server.url, TEST_KEY) as client,
        FakeAgents(fresh_agl_server.url, behaviour=behaviour) as agents,
    ):
        result = SyncRolloutManager(client, config).enqueue_and_wait_until_completed(_rows(3), is_train=True)
        left = _server_rollouts(client)
    assert agents.stats.errors == []
    timed_out = sorted(
        (r.sample_idx_in_step, r.rollout_state, r.error_message) for r in result.completed if r.timed_out
    )
    assert timed_out == [
        (0, RolloutState.FAILED, "timed out by trainer after 5 s"),
        (1, RolloutState.FAILED, "timed out by trainer after 5 s"),
    ]
    assert result.metrics["training/n_rollouts_timed_out"] == 2.0
    assert result.metrics["training/n_rollouts_failed"] == 0.0
    assert left == []


def test_running_time_is_recorded_from_the_server_status(agl_server: AglServerProcess) -> None:
    result = _wait_train(agl_server, 3, AgentBehaviour(delay_s=0.3))
    for r in result.completed:
        assert r.running_at is not None and r.finished_at is not None
        assert r.finished_at - r.running_at >= 0.3
    assert result.metrics["timing/rollout_n_missing_running_ts"] == 0.0
    assert result.metrics["timing/rollout_run_duration_s/p50"] >= 0.3


def test_the_callers_batch_is_not_mutated_and_no_key_is_added_to_the_input(
    agl_server: AglServerProcess,
) -> None:
    batch = {"x": [1, 2], "tags": [["a"], ["b"]]}
    with AglClient(agl_server.url, TEST_KEY) as client, FakeAgents(agl_server.url) as agents:
        result = SyncRolloutManager(client, _config()).enqueue_and_wait_until_completed(batch, is_train=True)
    assert agents.stats.errors == []
    assert batch == {"x": [1, 2], "tags": [["a"], ["b"]]}
    assert sorted(r.input["x"] for r in result.completed) == [1, 2]
    assert all(set(r.input) == {"x", "tags"} for r in result.completed)


def test_empty_batch_returns_nothing_without_a_request(agl_server: AglServerProcess) -> None:
    with AglClient(agl_server.url, TEST_KEY) as client:
        result = SyncRolloutManager(client, RolloutManagerConfig()).enqueue_and_wait_until_completed(
            {}, is_train=True
        )
        assert client.request_count == 0
    assert result.completed == []
