"""verl's training workers (actor; reference for KL; critic for GAE) without verl's rollout workers.

agl generates with external vLLM servers, so the trainer needs only verl's training side: the
actor (and ref/critic) workers. Stock ``RayPPOTrainer.init_workers`` also builds verl's own rollout
replicas, which fails where there is no vLLM (the CPU mode) and is wasted work elsewhere. This
module builds the same worker groups the way ``init_workers`` does (one colocated Ray actor per
rank hosting every role), with verl's own worker class plus the methods agl needs
(:class:`~agl_trainer.verl_glue.actor_worker.AglActorRefWorker`, re-exported here).

It also holds the Ray worker setup hook, :func:`setup_worker_process`, that every Ray worker runs
before its first task.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import remove_placement_group
from tensordict import TensorDict
from verl import DataProto
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.single_controller.ray.base import create_colocated_worker_cls
from verl.utils import tensordict_utils as tu
from verl.workers.config import TrainingWorkerConfig
from verl.workers.engine_workers import TrainingWorker
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from agl_trainer.verl_glue.actor_worker import AglActorRefWorker
from agl_trainer.verl_glue.cpu_platform import CpuActorRefWorker, CpuCriticWorker, enable_cpu_platform
from agl_trainer.verl_glue.probe import probe_batch

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = (
    "WORKER_SETUP_HOOK",
    "WORKER_SETUP_STEPS",
    "AglActorRefWorker",
    "PolicyWorkers",
    "build_policy_workers",
    "compose_verl_config",
    "critic_worker_config",
    "no_padding_batch",
    "ray_runtime_env",
    "setup_worker_process",
)

WORKER_SETUP_HOOK = "agl_trainer.verl_glue.workers.setup_worker_process"
"""Import path of :func:`setup_worker_process`, for Ray's ``worker_process_setup_hook``."""

_ALGOS_REGISTRATION_MODULE = "agl_algos.verl"
_ALGOS_REGISTRATION_FUNCTION = "register_in_worker"


def _enable_cpu_platform_if_selected() -> None:
    if os.environ.get("VERL_PLATFORM") == "cpu":
        enable_cpu_platform()


def _register_agl_algos() -> None:
    if importlib.util.find_spec(_ALGOS_REGISTRATION_MODULE) is None:
        return
    module = importlib.import_module(_ALGOS_REGISTRATION_MODULE)
    register_fn = getattr(module, _ALGOS_REGISTRATION_FUNCTION, None)
    if callable(register_fn):
        register_fn()


WORKER_SETUP_STEPS: tuple[Callable[[], None], ...] = (_enable_cpu_platform_if_selected, _register_agl_algos)
"""What :func:`setup_worker_process` runs, in order: the CPU platform first (it must precede any
verl module that reads the device at import), then agl-algos' registrations into verl."""


def setup_worker_process() -> None:
    """Ray worker setup hook: prepare verl in a fresh worker process.

    Runs every step of :data:`WORKER_SETUP_STEPS`. Each step is idempotent, so the hook is also
    safe to call in the driver.
    """
    for step in WORKER_SETUP_STEPS:
        step()


def ray_runtime_env(device: str) -> dict[str, Any]:
    """The ``runtime_env`` for ``ray.init``: the setup hook and the env vars the workers need.

    ``device`` is ``trainer.device``; ``"cpu"`` selects the CPU platform in every worker.
    """
    env_vars = {"TOKENIZERS_PARALLELISM": "false", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    if device == "cpu":
        env_vars["VERL_PLATFORM"] = "cpu"
    return {"worker_process_setup_hook": WORKER_SETUP_HOOK, "env_vars": env_vars}


def compose_verl_config(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose verl's own ``ppo_trainer`` Hydra config with ``overrides`` (Hydra override syntax)."""
    from hydra import compose, initialize_config_dir

    from agl_trainer.verl_glue.compat import verl_config_dir

    with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


def critic_worker_config(config: DictConfig) -> tuple[TrainingWorkerConfig, Any]:
    """verl's value-model worker config for ``config.critic``, and the ``CriticConfig`` its loss reads.

    Built as ``RayPPOTrainer.init_workers`` builds it: the critic is verl's generic
    ``TrainingWorker`` with a value-head engine, its token budgets taken from the critic section.
    """
    from verl.utils.config import omega_conf_to_dataclass

    critic: Any = omega_conf_to_dataclass(config.critic)
    engine = critic.engine
    engine.infer_max_token_len_per_gpu = critic.ppo_infer_max_token_len_per_gpu
    engine.max_token_len_per_gpu = critic.ppo_max_token_len_per_gpu
    worker_config = TrainingWorkerConfig(
        model_type="value_model",
        model_config=critic.model,
        engine_config=engine,
        optimizer_config=critic.optim,
        checkpoint_config=critic.checkpoint,
    )
    return worker_config, critic


def no_padding_batch(batch: DataProto, temperature: float) -> TensorDict:
    """``batch`` as verl's no-padding TensorDict (every per-token tensor, MoE routes included, cut to
    the attended tokens), with the sampling temperature verl's engine reads.

    ``batch.meta_info["temperature"]`` wins over ``temperature`` (the servers'
    ``actor_rollout_ref.rollout.temperature``); ``batch`` itself is left unchanged.
    """
    meta_info = {"temperature": temperature, **batch.meta_info}
    shallow = DataProto(batch=batch.batch, non_tensor_batch=batch.non_tensor_batch, meta_info=meta_info)
    return left_right_2_no_padding(shallow.to_tensordict())


@dataclass(frozen=True)
class PolicyWorkers:
    """The actor worker group and, when the config needs them, the reference and critic groups.

    ``actor``, ``ref`` and ``critic`` are verl ``RayWorkerGroup`` s over the same Ray actors (one per
    rank), as ``RayPPOTrainer`` holds them in ``actor_rollout_wg``, ``ref_policy_wg`` and ``critic_wg``.
    """

    config: DictConfig
    # RayWorkerGroup instances; their worker methods are bound at spawn time, so typed as Any.
    actor: Any
    ref: Any | None
    pool: RayResourcePool
    critic: Any | None = None

    def shutdown(self) -> None:
        """Kill the worker processes and free their placement groups (their CPUs/GPUs)."""
        for worker in self.actor.workers:
            ray.kill(worker)
        for group in self.pool.pgs or []:
            remove_placement_group(group)

    def _no_padding(self, batch: DataProto) -> TensorDict:
        return no_padding_batch(batch, self.config.actor_rollout_ref.rollout.temperature)

    def compute_log_prob(self, batch: DataProto) -> DataProto:
        """Actor log-probs of ``batch``'s responses: ``old_log_probs`` and ``entropys``, (B, R)."""
        batch_td = self._no_padding(batch)
        tu.assign_non_tensor(batch_td, calculate_entropy=True, compute_loss=False)
        output = self.actor.compute_log_prob(batch_td)
        result: dict[str, Any] = {
            "old_log_probs": no_padding_2_padding(tu.get(output, "log_probs"), batch_td).float(),
            "entropys": no_padding_2_padding(tu.get(output, "entropy"), batch_td).float(),
        }
        return DataProto.from_tensordict(tu.get_tensordict(result))

    def probe_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """The actor's log-prob of each of ``token_ids[1:]`` given its prefix, as a vLLM server
        answers ``prompt_logprobs`` for them; one log-prob micro-batch per rank, all rows alike."""
        micro = self.config.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu or 1
        scored = self.compute_log_prob(probe_batch(token_ids, rows=micro * self.actor.world_size))
        return [float(value) for value in scored.batch["old_log_probs"][0]]

    def compute_ref_log_prob(self, batch: DataProto) -> DataProto:
        """Reference log-probs of ``batch``'s responses: ``ref_log_prob``, (B, R)."""
        if self.ref is None:
            raise RuntimeError("compute_ref_log_prob needs a reference worker; the config uses no KL.")
        batch_td = self._no_padding(batch)
        tu.assign_non_tensor(batch_td, calculate_entropy=False, compute_loss=False)
        output = self.ref.compute_ref_log_prob(batch_td)
        log_probs = no_padding_2_padding(tu.get(output, "log_probs"), batch_td).float()
        return DataProto.from_tensordict(tu.get_tensordict({"ref_log_prob": log_probs}))

    def update_actor(self, batch: DataProto) -> dict[str, Any]:
        """One PPO update of the actor on ``batch``; returns verl's actor metrics, each under ``actor/``.

        ``batch`` holds the rollout tensors plus ``old_log_probs`` and ``advantages`` (B, R) (and
        ``ref_log_prob`` with KL loss), as ``RayPPOTrainer._update_actor`` receives it.
        """
        actor_config = self.config.actor_rollout_ref.actor
        rollout_config = self.config.actor_rollout_ref.rollout
        mini_batch_size = actor_config.ppo_mini_batch_size * rollout_config.n
        batch_td = self._no_padding(batch)
        tu.assign_non_tensor(
            batch_td,
            calculate_entropy=actor_config.calculate_entropy or actor_config.entropy_coeff != 0.0,
            distillation_use_topk=False,
            distillation_only=False,
            global_batch_size=mini_batch_size,
            mini_batch_size=mini_batch_size,
            epochs=actor_config.ppo_epochs,
            seed=actor_config.data_loader_seed,
            dataloader_kwargs={"shuffle": actor_config.shuffle},
            compute_loss=True,
        )
        metrics = tu.get(self.actor.update_actor(batch_td), "metrics")
        return {key if key.startswith("actor/") else f"actor/{key}": value for key, value in metrics.items()}

    def compute_values(self, batch: DataProto) -> DataProto:
        """The critic's value estimates of ``batch``'s responses: ``values``, (B, R)."""
        critic = self._critic()
        batch_td = self._no_padding(batch)
        tu.assign_non_tensor(batch_td, compute_loss=False)
        output = critic.infer_batch(batch_td).get()
        values = no_padding_2_padding(tu.get(output, "values"), batch_td).float()
        return DataProto.from_tensordict(tu.get_tensordict({"values": values}))

    def update_critic(self, batch: DataProto) -> dict[str, Any]:
        """One value-loss update of the critic on ``batch`` (which holds ``values`` and ``returns``).

        Returns verl's critic metrics under ``critic/`` (its MFU as ``perf/mfu/critic``), the
        names ``RayPPOTrainer._update_critic`` gives them.
        """
        critic = self._critic()
        critic_config = self.config.critic
        mini_batch_size = critic_config.ppo_mini_batch_size * self.config.actor_rollout_ref.rollout.n
        batch_td = self._no_padding(batch)
        tu.assign_non_tensor(
            batch_td,
            global_batch_size=mini_batch_size,
            mini_batch_size=mini_batch_size,
            epochs=critic_config.ppo_epochs,
            seed=critic_config.data_loader_seed,
            dataloader_kwargs={"shuffle": critic_config.shuffle},
        )
        output = critic.train_mini_batch(batch_td).get()
        metrics = {
            key if key.startswith("critic/") else f"critic/{key}": value
            for key, value in dict(tu.get(output, "metrics")).items()
        }
        if "critic/mfu" in metrics:
            metrics["perf/mfu/critic"] = metrics.pop("critic/mfu")
        return metrics

    def _critic(self) -> Any:
        if self.critic is None:
            raise RuntimeError(
                "the config uses no critic (algorithm.adv_estimator is not gae, critic.enable unset)"
            )
        return self.critic

    def save_hf_weights(self, path: str | os.PathLike[str]) -> Path:
        """Save the actor's weights as a Hugging Face model folder at ``path`` and return it."""
        self.actor.save_hf_weights(str(path))
        return Path(path)

    def save_lora_adapter(self, path: str | os.PathLike[str]) -> Path:
        """Save the actor's LoRA adapter as a PEFT folder at ``path`` and return it."""
        self.actor.save_lora_adapter(str(path))
        return Path(path)

    def describe_policy_loss(self) -> list[str]:
        """Per rank, ``module.qualname`` of the policy-loss function the actor workers resolve."""
        return list(self.actor.describe_policy_loss())

    def check_policy_loss(self, loss_mode: str) -> None:
        """Raise unless every actor rank resolves ``loss_mode`` to the driver's function.

        A loss registered in the driver but not in the workers (a missing setup hook) would
        otherwise fail only at the first update, or train with another function of that name.
        """
        from verl.trainer.ppo.core_algos import get_policy_loss_fn

        loss_fn = get_policy_loss_fn(loss_mode)
        expected = f"{loss_fn.__module__}.{loss_fn.__qualname__}"
        seen = self.describe_policy_loss()
        if any(name != expected for name in seen):
            raise RuntimeError(
                f"the actor workers resolve loss_mode={loss_mode!r} to {seen}, the driver to {expected}; "
                "the Ray worker setup hook did not register agl's losses (run through agl_trainer.run_ppo)"
            )


def build_policy_workers(
    config: DictConfig,
    *,
    use_reference_policy: bool | None = None,
    use_critic: bool | None = None,
    with_rollout: bool = False,
) -> PolicyWorkers:
    """Start the actor (and ref, critic) workers for ``config`` on the running Ray cluster and init them.

    ``config`` is a full verl PPO config (see :func:`compose_verl_config`). The pool has
    ``trainer.n_gpus_per_node`` ranks on each of ``trainer.nnodes`` nodes; with
    ``trainer.device=cpu`` those are CPU processes. ``use_reference_policy`` and ``use_critic``
    default to verl's own rules (KL in the loss or the reward; GAE or ``critic.enable``).
    ``with_rollout`` gives the actor workers verl's rollout role too (``actor_rollout``), which
    verl's hybrid-engine replicas need (:mod:`agl_trainer.serving.replicas`; GPUs only).
    """
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.workers.utils.losses import value_loss

    device = str(config.trainer.device)
    worker_cls: type[AglActorRefWorker] = AglActorRefWorker
    critic_cls: type[TrainingWorker] = TrainingWorker
    if device == "cpu":
        enable_cpu_platform()
        worker_cls, critic_cls = CpuActorRefWorker, CpuCriticWorker
    if use_reference_policy is None:
        use_reference_policy = need_reference_policy(config)
    if use_critic is None:
        use_critic = need_critic(config)
    actor_role = "actor_rollout" if with_rollout else "actor"
    roles = (actor_role, "ref") if use_reference_policy else (actor_role,)
    pool = RayResourcePool(
        process_on_nodes=[int(config.trainer.n_gpus_per_node)] * int(config.trainer.nnodes),
        use_gpu=device != "cpu",
        max_colocate_count=1,
    )
    remote_cls = ray.remote(worker_cls)
    class_dict = {
        role: RayClassWithInitArgs(cls=remote_cls, config=config.actor_rollout_ref, role=role)
        for role in roles
    }
    critic_config: Any = None
    if use_critic:
        worker_config, critic_config = critic_worker_config(config)
        class_dict["critic"] = RayClassWithInitArgs(cls=ray.remote(critic_cls), config=worker_config)
    colocated = RayWorkerGroup(
        resource_pool=pool,
        ray_cls_with_init=create_colocated_worker_cls(class_dict=class_dict),
        device_name=device,
    )
    groups = colocated.spawn(prefix_set=class_dict.keys())
    ref = groups.get("ref")
    if ref is not None:
        ref.init_model()
    critic = groups.get("critic")
    if critic is not None:
        critic.reset()  # builds the value model and its optimiser
        critic.set_loss_fn(partial(value_loss, config=critic_config))
    actor = groups[actor_role]
    actor.init_model()
    return PolicyWorkers(config=config, actor=actor, ref=ref, pool=pool, critic=critic)
