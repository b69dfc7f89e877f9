"""The hybrid path on CPU: verl's real replica manager, checkpoint engine and actor workers.

``AglRayPPOTrainer.init_workers`` with no external endpoints builds the actor workers with verl's
rollout role and starts verl's replicas through ``LLMServerManager`` and ``CheckpointEngineManager``
(:mod:`agl_trainer.serving.replicas`). Everything runs for real except vLLM itself, which needs a GPU: its
server actor is :class:`GpuBoundServerStandIn`, started by :class:`GpuBoundReplicaStandIn` (verl's
real ``RolloutReplica`` with only ``launch_servers`` replaced), and the worker-side client of that
server is :class:`GpuBoundRolloutStandIn`. Both are registered under the rollout name
:data:`STAND_IN`; the stand-ins record what verl asks of the server (sleep, wake-up, the weights it
receives, the config it was started with).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import ray
import torch
from omegaconf import DictConfig
from ray.exceptions import RayActorError
from transformers import AutoModelForCausalLM
from verl.workers.rollout import base as rollout_base
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry

from agl_testing.agl_server import TEST_KEY, AglServerProcess
from agl_trainer import cli
from agl_trainer.assembly import build_trainer, compose_config
from agl_trainer.local.tiny_model import build_tiny_model
from agl_trainer.serving.replicas import VerlReplicas
from agl_trainer.trainer import AglRayPPOTrainer
from agl_trainer.verl_glue.cpu_platform import CPU_MODE_OVERRIDES
from agl_trainer.verl_glue.workers import ray_runtime_env, setup_worker_process

pytestmark = [pytest.mark.verl, pytest.mark.slow]

STAND_IN = "gpu_bound_vllm_stand_in"
"""Rollout name of the stand-ins, in verl's replica registry (driver) and rollout registry (workers)."""
_WORKER_MODULE = "agl_gpu_bound_stand_in"
ROWS = [{"question": str(i)} for i in range(4)]


@ray.remote(num_cpus=0)
class GpuBoundServerStandIn:
    """Stands in for verl's ``vLLMHttpServer`` (a vLLM engine on the replica's GPUs).

    Records what verl asks of it. ``interrupt_pid``: sends that process SIGINT on the first wake-up,
    as a user's Ctrl-C in the middle of a weight sync.
    """

    def __init__(self, config: Any, replica_rank: int, interrupt_pid: int | None) -> None:
        self.config = config
        self.address = f"gpu-bound-server-stand-in-{replica_rank}:8000"
        self.interrupt_pid = interrupt_pid
        self.awake: set[str] = set()
        self.sleeps = 0
        self.loads: list[tuple[int | None, dict[str, float]]] = []

    def get_server_address(self) -> str:
        return self.address

    def served_model_name(self) -> str | None:
        return self.config.engine_kwargs.get("vllm", {}).get("served_model_name")

    def sleep(self) -> None:
        self.awake.clear()
        self.sleeps += 1

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self.interrupt_pid is not None:
            os.kill(self.interrupt_pid, signal.SIGINT)
            self.interrupt_pid = None
        self.awake.update(tags or ["weights", "kv_cache"])

    def load_weights(self, version: int | None, sums: dict[str, float]) -> None:
        self.loads.append((version, sums))

    def state(self) -> dict[str, Any]:
        return {"awake": sorted(self.awake), "sleeps": self.sleeps, "loads": self.loads}


def _server_name(config: Any, replica_rank: int) -> str:
    return f"{config.custom['server_prefix']}_server_{replica_rank}_0"


class GpuBoundReplicaStandIn(RolloutReplica):
    """verl's ``RolloutReplica`` launching :class:`GpuBoundServerStandIn` instead of vLLM's server."""

    interrupt_pid: ClassVar[int | None] = None

    async def launch_servers(self) -> None:
        server = GpuBoundServerStandIn.options(name=_server_name(self.config, self.replica_rank)).remote(
            self.config, self.replica_rank, self.interrupt_pid
        )
        self.servers.append(server)
        self._server_handle = server
        self._server_address = await server.get_server_address.remote()


class GpuBoundRolloutStandIn(BaseRollout):
    """Stands in for verl's worker-side ``ServerAdapter``, which hands weights to vLLM over CUDA IPC.

    Finds its replica's server by name, as the real one does, and sends it the sum of each tensor.
    """

    def __init__(self, config: Any, model_config: Any, device_mesh: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        self.server: Any = None

    def _server(self) -> Any:
        if self.server is None:
            self.server = ray.get_actor(_server_name(self.config, 0))
        return self.server

    async def resume(self, tags: list[str]) -> None:
        await self._server().wake_up.remote(tags)

    async def update_weights(self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any) -> None:
        sums = {name: float(tensor.double().sum()) for name, tensor in weights}
        await self._server().load_weights.remote(kwargs.get("global_steps"), sums)

    async def release(self) -> None:
        await self._server().sleep.remote()


def _setup_worker_with_stand_in() -> None:
    """agl's Ray worker setup hook, plus the worker-side stand-in in verl's rollout registry."""
    setup_worker_process()
    module = types.ModuleType(_WORKER_MODULE)
    module.GpuBoundRolloutStandIn = GpuBoundRolloutStandIn  # type: ignore[attr-defined]
    sys.modules[_WORKER_MODULE] = module
    rollout_base._ROLLOUT_REGISTRY[(STAND_IN, "async")] = f"{_WORKER_MODULE}.GpuBoundRolloutStandIn"  # pyright: ignore[reportPrivateUsage]


def start_ray() -> None:
    """Ray on 4 logical CPUs with the stand-ins registered in the driver and every worker: a
    cluster of its own, so the session's shared one (``ray_cluster``) is stopped first."""
    if ray.is_initialized():
        ray.shutdown()
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    RolloutReplicaRegistry.register(STAND_IN, lambda: GpuBoundReplicaStandIn)
    runtime_env = {**ray_runtime_env("cpu"), "worker_process_setup_hook": _setup_worker_with_stand_in}
    ray.init(num_cpus=4, include_dashboard=False, runtime_env=runtime_env)


def hybrid_overrides(model_path: Path) -> list[str]:
    """A hybrid-path config on CPU: no external endpoints, the stand-in as rollout backend."""
    return [
        *CPU_MODE_OVERRIDES,
        f"actor_rollout_ref.model.path={model_path}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        f"actor_rollout_ref.rollout.name={STAND_IN}",
        f"+actor_rollout_ref.rollout.custom={{server_prefix:{STAND_IN}_{uuid.uuid4().hex[:8]}}}",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "data.train_batch_size=2",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.logger=[console]",
        "trainer.val_before_train=false",
        "agentlightning.agl_base_url=http://127.0.0.1:9",
        "agentlightning.served_model_name=policy",
    ]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("hybrid") / "model", seed=0)


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    start_ray()
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def trainer(ray_session: None, model_path: Path) -> Iterator[AglRayPPOTrainer]:
    trainer = build_trainer(compose_config(hybrid_overrides(model_path)), ROWS, ROWS)
    try:
        yield trainer
    finally:
        trainer.shutdown()


@pytest.fixture(scope="module")
def server_state_after_init(trainer: AglRayPPOTrainer) -> dict[str, Any]:
    """The replica server's record as ``init_workers`` left it, before any test pushed (tests run shuffled)."""
    return ray.get(server_of(trainer.config).state.remote())


def server_of(config: DictConfig) -> Any:
    return ray.get_actor(_server_name(config.actor_rollout_ref.rollout, 0))


def replicas_of(trainer: AglRayPPOTrainer) -> VerlReplicas:
    assert trainer.replicas is not None
    return trainer.replicas


def test_hybrid_init_starts_the_replicas_asleep_and_points_the_gateway_at_them(
    trainer: AglRayPPOTrainer, server_state_after_init: dict[str, Any]
) -> None:
    assert (
        list(trainer.publisher.endpoints)
        == ["gpu-bound-server-stand-in-0:8000"]
        == replicas_of(trainer).addresses
    )
    assert trainer.publisher.pusher is trainer.replicas
    assert server_state_after_init == {"awake": [], "sleeps": 1, "loads": []}


def test_hybrid_replicas_are_started_serving_the_gateways_model_name(trainer: AglRayPPOTrainer) -> None:
    assert ray.get(server_of(trainer.config).served_model_name.remote()) == "policy"


def test_push_wakes_the_replicas_with_the_actors_weights_and_release_sleeps_them(
    trainer: AglRayPPOTrainer, server_state_after_init: dict[str, Any], model_path: Path
) -> None:
    server = server_of(trainer.config)
    replicas = replicas_of(trainer)
    metrics = replicas.push(trainer.workers, 0)
    state = ray.get(server.state.remote())
    assert metrics["training/weight_version"] == 0.0
    assert state["awake"] == ["kv_cache", "weights"]
    [(version, sums)] = state["loads"]
    expected = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
    assert version == 0 and sums and set(sums) <= set(expected)
    for name, total in sums.items():
        assert total == pytest.approx(float(expected[name].double().sum()), rel=1e-5, abs=1e-5)

    replicas.push(trainer.workers, 0)  # already serving version 0: nothing moves
    assert len(ray.get(server.state.remote())["loads"]) == 1
    replicas.release()
    assert ray.get(server.state.remote())["awake"] == []
    replicas.push(trainer.workers, 1)
    assert [v for v, _ in ray.get(server.state.remote())["loads"]] == [0, 1]


def test_shutdown_stops_every_replica_server_and_the_load_balancer(
    ray_session: None, model_path: Path
) -> None:
    trainer = build_trainer(compose_config(hybrid_overrides(model_path)), ROWS, ROWS)
    servers: Any = replicas_of(trainer)._servers  # pyright: ignore[reportPrivateUsage]
    started = [server for replica in servers.get_replicas() for server in replica.servers]
    started.append(servers.global_load_balancer)
    trainer.shutdown()
    for handle in started:
        with pytest.raises(RayActorError):
            ray.get(handle.__ray_ready__.remote())


@pytest.mark.server
def test_ctrl_c_stops_every_replica_and_prints_the_step_and_checkpoint(
    ray_session: None,
    model_path: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    fresh_agl_server: AglServerProcess,
) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    overrides = [
        *hybrid_overrides(model_path),
        # The first publish pauses and drains the gateway before the weight sync Ctrl-C stops.
        f"agentlightning.agl_base_url={fresh_agl_server.url}",
        f"agentlightning.agl_key={TEST_KEY}",
        f"data.train_files={rows}",
        f"data.val_files={rows}",
        f"trainer.default_local_dir={tmp_path / 'checkpoints'}",
    ]
    started: list[Any] = []
    launch = GpuBoundReplicaStandIn.launch_servers

    async def launch_and_remember(self: GpuBoundReplicaStandIn) -> None:
        await launch(self)
        started.extend(self.servers)

    loggers = [logging.getLogger(name) for name in cli.AGL_LOGGERS]
    handlers = [list(logger.handlers) for logger in loggers]
    GpuBoundReplicaStandIn.interrupt_pid = os.getpid()  # Ctrl-C during the first weight sync
    GpuBoundReplicaStandIn.launch_servers = launch_and_remember  # type: ignore[method-assign]
    # A test command started in the background (`cmd &`) inherits SIGINT ignored; a user's
    # foreground Ctrl-C raises KeyboardInterrupt, so this test restores that for its duration.
    inherited_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(overrides)
    finally:
        signal.signal(signal.SIGINT, inherited_sigint)
        GpuBoundReplicaStandIn.interrupt_pid = None
        GpuBoundReplicaStandIn.launch_servers = launch  # type: ignore[method-assign]
        for logger, before in zip(loggers, handlers, strict=True):  # main() configures agl's loggers
            logger.handlers[:] = before
            logger.propagate = True
    assert exit_info.value.code == 130
    err = capsys.readouterr().err
    assert "agl-trainer: interrupted at step 0; no checkpoint saved" in err.splitlines()
    assert "Traceback" not in err
    assert started
    for handle in started:
        with pytest.raises(RayActorError):
            ray.get(handle.__ray_ready__.remote())
