"""``AglRayPPOTrainer``: verl's ``RayPPOTrainer`` with rollouts collected from real agents.

verl keeps the optimiser, FSDP, KL, the critic, checkpointing and the worker RPCs; what changes is where a
step's data comes from: rollouts queued on agl-server and run by agents anywhere, their
``model_request`` events turned into training rows by agl-adapter, with agl-algos' rollout-level
advantage and per-rollout losses. The step, in order, is :meth:`AglRayPPOTrainer.train_step`; each
stage has its module: collection (with dynamic sampling), adapter, overlong shaping, batching,
correction, advantages, rollout normalisation, publisher.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from tqdm import tqdm
from verl.single_controller.ray import RayWorkerGroup
from verl.trainer.ppo.metric_utils import compute_timing_metrics
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.trainer.ppo.utils import Role
from verl.utils.debug import marked_timer
from verl.utils.metric import reduce_metrics
from verl.utils.tracking import Tracking

from agl_adapter import EmptyBatchError
from agl_rollout import AglClient, BatchTopUp
from agl_trainer.datasets import collate_rows
from agl_trainer.run_state import RunState
from agl_trainer.serving.publisher import Publisher
from agl_trainer.serving.replicas import VerlReplicas
from agl_trainer.serving.weights import NoWeightPush, WeightPusher
from agl_trainer.settings import AglSettings, gateway_model_name, validate_config
from agl_trainer.step.advantages import Advantages
from agl_trainer.step.batching import cut_batch
from agl_trainer.step.collection import Collection, registrations_for
from agl_trainer.step.correction import (
    compute_old_log_probs,
    configure_actor_loss,
    training_correction,
    validate_rollout_correction,
)
from agl_trainer.step.overlong import OverlongShaping
from agl_trainer.step.rollout_normalization import RolloutNormalization
from agl_trainer.verl_glue.workers import AglActorRefWorker, PolicyWorkers, build_policy_workers
from agl_types import CompletedRollout

logger = logging.getLogger(__name__)


class AglRayPPOTrainer(RayPPOTrainer):
    """GRPO on agent rollouts; see the module docstring.

    Agents reach the inference servers through the gateway: the ones named in
    ``agentlightning.external_servers.endpoints``, to which the publisher's ``weight_pusher`` gives the actor's
    weights after each update; or, with that list empty, verl's own vLLM replicas, which
    :meth:`init_workers` starts and which then push for themselves (:mod:`agl_trainer.serving.replicas`).
    ``processor`` is the model's HF processor (verl's ``hf_processor``; None for a text model): each
    model call's images are then fetched with it and encoded into the batch.
    """

    def __init__(
        self,
        config: DictConfig,
        tokenizer: Any,
        *,
        train_dataset: Any,
        val_dataset: Any,
        weight_pusher: WeightPusher | None = None,
        processor: Any | None = None,
    ) -> None:
        self.settings: AglSettings = validate_config(config)
        self.correction = training_correction(
            validate_rollout_correction(config), self.settings.default_behaviour_weight_cap
        )
        self.normalization = RolloutNormalization.from_config(config)
        # before the workers copy the actor config
        configure_actor_loss(config, self.correction)
        self.normalization.configure_actor(config)
        super().__init__(
            config=config,
            tokenizer=tokenizer,
            processor=processor,
            role_worker_mapping={Role.ActorRollout: AglActorRefWorker},
            resource_pool_manager=None,  # type: ignore[arg-type]  (workers are built by build_policy_workers)
            ray_worker_group_cls=RayWorkerGroup,
            train_dataset=train_dataset,
            val_dataset=val_dataset,
            collate_fn=collate_rows,
        )
        self.endpoints = list(self.settings.external_endpoints)
        self.client = AglClient(self.settings.agl_base_url, self.settings.agl_key or None)
        self.weight_version = 0
        """Published actor updates: a step that updates nothing (empty batch, critic warm-up) ages no group."""
        registrations = registrations_for(
            gateway_model_name(config), self.endpoints, lambda: self.weight_version
        )
        top_up = BatchTopUp(lambda: iter(self.train_dataloader))
        self.collection = Collection.from_config(
            config, self.settings, self.client, top_up, include_images=processor is not None
        )
        self.publisher = Publisher(
            self.client,
            weight_pusher or NoWeightPush(),
            registrations,
            resume=self.settings.fully_async,
            drain=self.settings.drain,
        )
        self.adapter = self.settings.adapter(tokenizer, processor)
        self.overlong = OverlongShaping.from_config(config, self.settings.max_response_length)
        self.advantages = Advantages(config, use_critic=self.use_critic)
        self._rng = np.random.default_rng(int(config.actor_rollout_ref.actor.get("data_loader_seed") or 0))
        self.policy_workers: PolicyWorkers | None = None
        self.replicas: VerlReplicas | None = None

    # ---- workers -------------------------------------------------------------------------------

    def init_workers(self) -> None:
        """Build verl's actor (and ref, critic) workers, and verl's vLLM replicas unless servers are external."""
        workers = build_policy_workers(
            self.config,
            use_reference_policy=self.use_reference_policy,
            use_critic=self.use_critic,
            with_rollout=self.settings.uses_verl_replicas,
        )
        self.policy_workers = workers
        self.actor_rollout_wg = workers.actor
        if workers.ref is not None:
            self.ref_policy_wg = workers.ref
        if workers.critic is not None:
            self.critic_wg = workers.critic
        self.distillation_config = None  # pyright: ignore[reportAttributeAccessIssue]  (no distillation)
        workers.check_policy_loss(str(self.config.actor_rollout_ref.actor.policy_loss.loss_mode))
        if self.settings.uses_verl_replicas:
            self.replicas = VerlReplicas.start(self.config, workers)
            self.endpoints[:] = self.replicas.addresses
            self.publisher.pusher = self.replicas

    def shutdown(self) -> None:
        """Stop the collector, the replicas and workers and close the server client; Ray itself stays up."""
        self.collection.stop()
        if self.replicas is not None:
            self.replicas.shutdown()
            self.replicas = None
        if self.policy_workers is not None:
            self.policy_workers.shutdown()
            self.policy_workers = None
        self.client.close()

    @property
    def workers(self) -> PolicyWorkers:
        if self.policy_workers is None:
            raise RuntimeError("init_workers() has not been called")
        return self.policy_workers

    # ---- one training step -----------------------------------------------------------------------

    def train_step(self, timing: dict[str, float]) -> dict[str, Any]:
        """Collect, adapt, cut, release the inference servers' memory, score, update (critic, then
        actor after ``trainer.critic_warmup`` steps), publish. Returns the step's metrics.

        A step whose batch ends up with zero trainable rows logs why and returns its metrics
        without an update; the caller still validates and checkpoints on schedule.
        """
        metrics: dict[str, Any] = {"timing/step_start_wall": time.time()}
        with marked_timer("gen", timing):
            completed, rollout_metrics = self.collection.take(self.global_steps, self.weight_version)
        metrics.update(rollout_metrics)
        self._train_on(completed, timing, metrics)
        return metrics

    def _train_on(
        self, completed: list[CompletedRollout], timing: dict[str, float], metrics: dict[str, Any]
    ) -> None:
        with marked_timer("adapter", timing):
            try:
                built, adapter_metrics = self.adapter.build_batch(completed, global_steps=self.global_steps)
            except EmptyBatchError as err:
                logger.warning("step %d has no training rows: %s", self.global_steps, err)
                metrics["training/n_sample_trained"] = 0
                return
        metrics.update(adapter_metrics)
        batch = built.to_data_proto()
        if self.overlong is not None:
            self.overlong.apply(batch, metrics)
        with marked_timer("cut", timing):
            batch = cut_batch(
                batch,
                self.config,
                metrics,
                max_ppo_update_times=self.settings.max_ppo_update_times,
                rng=self._rng,
                step=self.global_steps,
            )
        if batch is None:
            return
        batch.meta_info["temperature"] = float(self.config.actor_rollout_ref.rollout.temperature)
        batch.meta_info["global_token_num"] = torch.sum(batch.batch["attention_mask"], dim=-1).tolist()
        if self.config.trainer.balance_batch:
            self._balance_batch(batch, metrics=metrics)
        self.publisher.pusher.release()
        with marked_timer("old_log_prob", timing):
            old = compute_old_log_probs(
                batch,
                self.correction,
                recompute=self.workers.compute_log_prob,
                policy_loss=self.config.actor_rollout_ref.actor.policy_loss,
            )
            batch = old.batch
            metrics.update(old.metrics)
        if self.use_reference_policy:
            with marked_timer("ref", timing):
                batch = batch.union(self.workers.compute_ref_log_prob(batch))
        if self.use_critic:
            with marked_timer("values", timing):
                batch = batch.union(self.workers.compute_values(batch))
        with marked_timer("adv", timing):
            self.advantages.compute(batch, metrics)
            self.normalization.apply(batch, metrics)
        if self.use_critic:
            with marked_timer("update_critic", timing):
                metrics.update(reduce_metrics(self.workers.update_critic(batch)))
        if int(self.config.trainer.critic_warmup) <= self.global_steps:
            with marked_timer("update_actor", timing):
                metrics.update(reduce_metrics(self.workers.update_actor(batch)))
            self.weight_version += 1
        with marked_timer("update_weights", timing):
            metrics.update(self.publisher.publish(self.workers, self.weight_version))
        metrics.update(compute_timing_metrics(batch=batch, timing_raw=timing))

    # ---- validation, checkpoints, loop -------------------------------------------------------------

    def validate(self) -> dict[str, float]:
        """Run every validation batch through the rollout path; metrics over all of them at once."""
        completed, drain = self.collection.val_rollouts(self.val_dataloader, self.global_steps)
        return {**self.adapter.get_test_metrics(completed, global_steps=self.global_steps), **drain}

    def _save_checkpoint(self) -> None:
        """agl's state first, then verl's (whose marker file names the newest checkpoint), with no
        sample drawn in between: the held groups and verl's dataloader state agree."""
        with self.collection.admission_held():
            state = RunState(
                self.weight_version, self.collection.state(), self.collection.top_up.leftover_rows()
            )
            state.save(self.config, self.global_steps)
            super()._save_checkpoint()

    def _load_checkpoint(self) -> Any:
        result = super()._load_checkpoint()
        state = RunState.load(self.config, self.global_steps)
        if state is not None:
            self.weight_version = state.weight_version
            self.collection.restore(state.async_state, state.leftover_samples)
        else:
            self.weight_version = self.global_steps  # a checkpoint of verl alone: one update per step
        return result

    def fit(self) -> None:
        """verl's loop: optional validation first, then steps; validate and save on schedule.

        A step that trained nothing is still logged, and validation and checkpoints still run on
        schedule, always on the last step (the reference skips all three for such a step).
        """
        trainer_cfg = self.config.trainer
        tracker = Tracking(
            project_name=trainer_cfg.project_name,
            experiment_name=trainer_cfg.experiment_name,
            default_backend=trainer_cfg.logger,
            config=None,
        )
        try:
            self._fit(tracker)
        except BaseException:
            tracker.finish(exit_code=1)
            raise
        finally:
            self.collection.stop()
        tracker.finish(exit_code=0)

    def _fit(self, tracker: Tracking) -> None:
        trainer_cfg = self.config.trainer
        self.global_steps = 0
        self._load_checkpoint()
        self.publisher.publish(self.workers, self.weight_version)
        if trainer_cfg.get("val_before_train", True):
            tracker.log(data=self.validate(), step=self.global_steps)
            if trainer_cfg.get("val_only", False):
                return
        self.collection.start(steps_done=self.global_steps)
        progress = tqdm(total=self.total_training_steps, initial=self.global_steps, desc="Training Progress")
        self.global_steps += 1
        while self.global_steps <= self.total_training_steps:
            timing: dict[str, float] = {}
            with marked_timer("step", timing):
                metrics = self.train_step(timing)
            is_last = self.global_steps >= self.total_training_steps
            if trainer_cfg.test_freq > 0 and (is_last or self.global_steps % trainer_cfg.test_freq == 0):
                with marked_timer("testing", timing):
                    metrics.update(self.validate())
            if trainer_cfg.save_freq > 0 and (is_last or self.global_steps % trainer_cfg.save_freq == 0):
                with marked_timer("save_checkpoint", timing):
                    self._save_checkpoint()
            self.collection.step_done()
            metrics.update({f"timing_s/{name}": seconds for name, seconds in timing.items()})
            tracker.log(data=metrics, step=self.global_steps)
            progress.update(1)
            self.global_steps += 1
        progress.close()


__all__ = ("AglRayPPOTrainer",)
