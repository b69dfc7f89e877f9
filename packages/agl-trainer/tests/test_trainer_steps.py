"""AglRayPPOTrainer end to end on CPU: real Ray, verl's own workers, the real agl-server, fake agents.

Agents are agl-rollout's test agents (no inference server: this test is about the trainer), so
no weights are pushed; every other part of the step runs for real.
"""

from __future__ import annotations

import itertools
import json
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agl_testing.agents import AgentBehaviour, FakeAgents
from agl_testing.agl_server import TEST_KEY, AglServerProcess
from agl_testing.trainer_spies import record_trained_data_ids
from agl_trainer.assembly import build_trainer, compose_config
from agl_trainer.local.tiny_model import build_tiny_model
from agl_trainer.trainer import AglRayPPOTrainer
from agl_trainer.verl_glue.cpu_platform import CPU_MODE_OVERRIDES

pytestmark = [pytest.mark.verl, pytest.mark.server, pytest.mark.slow]

TRAIN_ROWS = [{"x": i} for i in range(8)]
VAL_ROWS = [{"x": 100 + i} for i in range(2)]


def _alternating(slow_x: int | None = None) -> Callable[[dict[str, Any]], AgentBehaviour]:
    """Within each group, every other rollout emits other tokens and earns 1: every group has
    reward variance and a gradient. Rollouts of sample ``slow_x`` take 30 s."""
    seen: Counter[int] = Counter()

    def behaviour(rollout: dict[str, Any]) -> AgentBehaviour:
        x = int(rollout["input"]["x"])
        shift = seen[x] % 2
        seen[x] += 1
        delay = 30.0 if x == slow_x else 0.0
        return AgentBehaviour(turns=2, reward=float(shift), token_shift=shift, delay_s=delay)

    return behaviour


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("trainer") / "model", seed=0)


def _overrides(model_path: Path, server: AglServerProcess, out: Path, *extra: str) -> list[str]:
    return [
        *CPU_MODE_OVERRIDES,
        f"actor_rollout_ref.model.path={model_path}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.actor.use_dynamic_bsz=false",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.optim.weight_decay=0",
        "data.train_batch_size=2",
        "data.val_batch_size=1",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.total_training_steps=2",
        "trainer.val_before_train=false",
        "trainer.test_freq=2",
        "trainer.save_freq=1",
        "trainer.logger=[console]",
        "trainer.balance_batch=false",
        f"trainer.default_local_dir={out / 'ckpt'}",
        f"agentlightning.agl_base_url={server.url}",
        f"agentlightning.agl_key={TEST_KEY}",
        "agentlightning.poll_interval_seconds=0.05",
        "agentlightning.trace_aggregator.trajectory_max_prompt_length=16",
        "agentlightning.trace_aggregator.trajectory_max_response_length=32",
        "agentlightning.external_servers.endpoints=[http://127.0.0.1:9/v1]",
        *extra,
    ]


_LIVE: list[AglRayPPOTrainer] = []


def _trainer(model_path: Path, server: AglServerProcess, out: Path, *extra: str) -> AglRayPPOTrainer:
    config = compose_config(_overrides(model_path, server, out, *extra))
    trainer = build_trainer(config, TRAIN_ROWS, VAL_ROWS)
    _LIVE.append(trainer)
    return trainer


def _release_workers(trainer: AglRayPPOTrainer) -> None:
    trainer.shutdown()
    _LIVE.remove(trainer)


@pytest.fixture(autouse=True)
def _release_all_workers() -> Iterator[None]:
    """Each test's workers hold the cluster's CPUs; free them whatever the test's outcome."""
    yield
    for trainer in list(_LIVE):
        _release_workers(trainer)


def test_sync_step_trains_on_all_rollouts_and_leaves_server_empty(
    model_path: Path, fresh_agl_server: AglServerProcess, ray_cluster: None, tmp_path: Path
) -> None:
    trainer = _trainer(model_path, fresh_agl_server, tmp_path)
    pushes = _record_weight_pushes(trainer)
    with FakeAgents(fresh_agl_server.url, behaviour=_alternating()) as agents:
        before = trainer.workers.compute_log_prob(_probe_batch(trainer)).batch["old_log_probs"]
        timing: dict[str, float] = {}
        trainer.global_steps = 1
        trainer.collection.start(steps_done=0)
        metrics = trainer.train_step(timing)
        after = trainer.workers.compute_log_prob(_probe_batch(trainer)).batch["old_log_probs"]
    assert metrics["training/n_rollouts"] == 4
    assert metrics["training/n_sample_trained"] == 4
    assert "actor/pg_clipfrac" in metrics
    assert metrics["actor/grad_norm"] > 0
    assert not bool((before == after).all()), "the actor's weights did not change"
    assert pushes == ["release", "push 1"]  # servers freed before training, given version 1 after
    assert len(agents.stats.claimed) == 4
    assert trainer.client.list_rollouts(["queuing", "running", "succeeded", "failed"]) == []


def test_gae_step_trains_the_critic_then_the_actor_and_checkpoints_both(
    model_path: Path, fresh_agl_server: AglServerProcess, ray_cluster: None, tmp_path: Path
) -> None:
    trainer = _trainer(
        model_path,
        fresh_agl_server,
        tmp_path,
        "algorithm.adv_estimator=gae",
        "algorithm.enable_rollout_level_advantage=false",
        "critic.ppo_micro_batch_size_per_gpu=1",
        "critic.optim.lr=1e-3",
        "critic.model.enable_gradient_checkpointing=false",
    )
    with FakeAgents(fresh_agl_server.url, behaviour=_alternating()):
        before = trainer.workers.compute_values(_probe_batch(trainer)).batch["values"]
        trainer.global_steps = 1
        trainer.collection.start(steps_done=0)
        metrics = trainer.train_step({})
        after = trainer.workers.compute_values(_probe_batch(trainer)).batch["values"]
    assert metrics["training/n_sample_trained"] == 4
    assert {"critic/vf_loss", "critic/grad_norm", "critic/values/mean", "critic/returns/mean"} <= set(metrics)
    assert metrics["actor/grad_norm"] > 0
    assert not bool((before == after).all()), "the critic's weights did not change"
    trainer._save_checkpoint()
    assert (tmp_path / "ckpt" / "global_step_1" / "critic").is_dir()


def test_fit_runs_two_async_steps_with_carry_over_and_resumes(
    model_path: Path, fresh_agl_server: AglServerProcess, ray_cluster: None, tmp_path: Path
) -> None:
    extra = (
        "agentlightning.async_rollout.enabled=true",
        "agentlightning.async_rollout.async_train_batch_size=3",
    )
    with FakeAgents(fresh_agl_server.url, behaviour=_alternating(slow_x=0)):
        trainer = _trainer(model_path, fresh_agl_server, tmp_path, *extra)
        pushes = _record_weight_pushes(trainer)
        trainer.fit()
        assert trainer.global_steps == 3
        assert pushes == ["push 0", "release", "push 1", "release", "push 2"]
        state = json.loads((tmp_path / "ckpt" / "global_step_2" / "agl_state.json").read_text())
        assert state["weight_version"] == 2
        assert len(state["async_state"]["groups"]) >= 1  # the slow group is carried, not lost
        _release_workers(trainer)  # free the CPUs for the resumed trainer's workers

        resumed = _trainer(model_path, fresh_agl_server, tmp_path, *extra, "trainer.total_training_steps=3")
        trained = record_trained_data_ids(resumed)
        resumed_pushes = _record_weight_pushes(resumed)
        resumed.fit()
    assert resumed.global_steps == 4
    assert resumed_pushes == ["push 2", "release", "push 3"]  # the checkpoint's weights first
    after = json.loads((tmp_path / "ckpt" / "global_step_3" / "agl_state.json").read_text())
    assert after["weight_version"] == 3
    assert len(trained) == 4  # step 3 trained two whole groups of rollout.n=2
    carried = {group["data_id"] for group in state["async_state"]["groups"]}
    still_carried = {group["data_id"] for group in after["async_state"]["groups"]}
    assert carried <= set(trained) | still_carried  # every carried group was trained or is still held


def test_step_with_no_trainable_rows_is_logged_and_still_writes_trajectories_validates_and_checkpoints(
    model_path: Path, fresh_agl_server: AglServerProcess, ray_cluster: None, tmp_path: Path
) -> None:
    trainer = _trainer(
        model_path,
        fresh_agl_server,
        tmp_path,
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.total_training_steps=1",
    )
    steps = _record_step_metrics(trainer)
    pushes = _record_weight_pushes(trainer)
    with FakeAgents(fresh_agl_server.url, behaviour=AgentBehaviour(turns=1, reward=1.0)) as agents:
        trainer.fit()
    assert pushes == ["push 0"]  # a step that trains nothing neither frees nor reloads the servers
    assert steps[0]["training/n_sample_collected"] == 4
    assert steps[0]["training/n_sample_trained"] == 0
    assert trainer.weight_version == 0
    assert len(agents.stats.claimed) == 4 + len(VAL_ROWS)  # the last step validated
    state = json.loads((tmp_path / "ckpt" / "global_step_1" / "agl_state.json").read_text())
    assert state["weight_version"] == 0
    written = tmp_path / "ckpt" / "trajectories" / "step_1"
    train = _zipped_jsonl(written / "train_trajectories.jsonl.zip")
    assert [(r["n_turns"], r["reward"], r["mismatch"]) for r in train] == [(1, 1.0, "none")] * 4
    validation = _zipped_jsonl(written / "validation_trajectories.jsonl.zip")
    assert len(validation) == len(VAL_ROWS)
    assert sorted(r["rollout_id"] for r in train + validation) == sorted(agents.stats.claimed)


def test_the_weight_version_counts_published_updates_so_a_step_that_trains_nothing_ages_no_group(
    model_path: Path, fresh_agl_server: AglServerProcess, ray_cluster: None, tmp_path: Path
) -> None:
    trainer = _trainer(
        model_path,
        fresh_agl_server,
        tmp_path,
        "agentlightning.drop_failed_rollouts=true",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
    )
    steps = _record_step_metrics(trainer)
    pushes = _record_weight_pushes(trainer)
    claimed = itertools.count()
    alternating = _alternating()

    def first_step_fails(rollout: dict[str, Any]) -> AgentBehaviour:
        # The first step's 4 rollouts fail and are dropped: no training row; later ones train.
        if next(claimed) < 4:
            return AgentBehaviour(outcome="failed", reward=None)
        return alternating(rollout)

    with FakeAgents(fresh_agl_server.url, behaviour=first_step_fails):
        trainer.fit()
    assert [s["training/n_sample_trained"] for s in steps] == [0, 4]
    assert trainer.weight_version == 1  # one update was published, over two steps
    assert pushes == ["push 0", "release", "push 1"]


def test_startup_hook_that_raises_is_logged_and_training_goes_on(
    model_path: Path,
    fresh_agl_server: AglServerProcess,
    ray_cluster: None,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    hooks_file = tmp_path / "hooks.py"
    hooks_file.write_text(
        "from agl_rollout import RolloutHooks\n\n"
        "class BrokenStartup(RolloutHooks):\n"
        "    def on_startup(self) -> None:\n"
        "        raise RuntimeError('startup broke')\n"
    )
    trainer = _trainer(
        model_path,
        fresh_agl_server,
        tmp_path,
        f"agentlightning.hooks={hooks_file}",
        "trainer.total_training_steps=1",
    )
    with (
        caplog.at_level("ERROR", logger="agl_rollout"),
        FakeAgents(fresh_agl_server.url, behaviour=_alternating()),
    ):
        trainer.fit()
    assert any("hook=on_startup" in record.getMessage() for record in caplog.records)
    assert trainer.global_steps == 2  # the one step ran


def test_a_val_only_run_opens_the_hooks_before_validating_and_ends_with_the_gateway_resumed(
    model_path: Path, fresh_agl_server: AglServerProcess, ray_cluster: None, tmp_path: Path
) -> None:
    hooks_file = tmp_path / "hooks.py"
    log = tmp_path / "hooks.log"
    hooks_file.write_text(
        "from pathlib import Path\n"
        "from agl_rollout import RolloutHooks\n\n"
        "class Judge(RolloutHooks):\n"
        "    judge = None\n\n"
        "    def on_startup(self, store=None) -> None:\n"
        "        self.judge = 'open'\n\n"
        "    def on_succeeded(self, rollout, events, store) -> None:\n"
        f"        with Path({str(log)!r}).open('a') as out:\n"
        "            out.write(f'{self.judge}\\n')\n"
    )
    trainer = _trainer(
        model_path,
        fresh_agl_server,
        tmp_path,
        f"agentlightning.hooks={hooks_file}",
        "trainer.val_before_train=true",
        "trainer.val_only=true",
    )
    with FakeAgents(fresh_agl_server.url, behaviour=AgentBehaviour(reward=1.0)) as agents:
        trainer.fit()
    assert len(agents.stats.claimed) == len(VAL_ROWS)
    assert log.read_text().splitlines() == ["open"] * len(VAL_ROWS)  # on_startup ran before them
    assert fresh_agl_server.rollout_ids() == []
    assert trainer.client.proxy_state().paused is False  # the first publish paused it (sync)


def test_fit_finishes_the_tracker_with_exit_code_1_when_a_step_raises(
    model_path: Path,
    fresh_agl_server: AglServerProcess,
    ray_cluster: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import agl_trainer.trainer as trainer_module

    exit_codes: list[int] = []

    class RecordingTracking(trainer_module.Tracking):
        def finish(self, exit_code: int = 0) -> None:
            if not getattr(self, "_finished", False):  # verl's __del__ calls it again, as a no-op
                exit_codes.append(exit_code)
            super().finish(exit_code=exit_code)

    monkeypatch.setattr(trainer_module, "Tracking", RecordingTracking)
    trainer = _trainer(model_path, fresh_agl_server, tmp_path, "trainer.total_training_steps=1")

    def broken_step(timing: dict[str, float]) -> dict[str, Any]:
        raise RuntimeError("step broke")

    trainer.train_step = broken_step  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="step broke"):
        trainer.fit()
    assert exit_codes == [1]


def _zipped_jsonl(path: Path) -> list[dict[str, Any]]:
    with zipfile.ZipFile(path) as archive:
        [member] = archive.namelist()
        return [json.loads(line) for line in archive.read(member).decode().splitlines()]


def _record_weight_pushes(trainer: AglRayPPOTrainer) -> list[str]:
    """Spy on the weight pusher: ``"release"`` and ``"push <version>"``, in call order."""
    seen: list[str] = []
    pusher = trainer.publisher.pusher
    release, push = pusher.release, pusher.push

    def recording_release() -> None:
        seen.append("release")
        release()

    def recording_push(workers: Any, version: int) -> dict[str, float]:
        seen.append(f"push {version}")
        return push(workers, version)

    pusher.release = recording_release  # type: ignore[method-assign]
    pusher.push = recording_push  # type: ignore[method-assign]
    return seen


def _record_step_metrics(trainer: AglRayPPOTrainer) -> list[dict[str, Any]]:
    """Spy on train_step: each step's metrics, in order."""
    seen: list[dict[str, Any]] = []
    train_step = trainer.train_step

    def recording(timing: dict[str, float]) -> dict[str, Any]:
        metrics = train_step(timing)
        seen.append(dict(metrics))
        return metrics

    trainer.train_step = recording  # type: ignore[method-assign]
    return seen


def _probe_batch(trainer: AglRayPPOTrainer) -> Any:
    import torch
    from verl import DataProto

    prompt_len, response_len = (
        trainer.settings.adapter.max_prompt_length,
        trainer.settings.adapter.max_response_length,
    )
    prompts = torch.full((2, prompt_len), 5, dtype=torch.long)
    responses = torch.full((2, response_len), 7, dtype=torch.long)
    attention = torch.ones(2, prompt_len + response_len, dtype=torch.long)
    return DataProto.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention,
            "position_ids": (attention.cumsum(dim=1) - 1).clamp(min=0),
            "response_mask": attention[:, prompt_len:],
        }
    )
