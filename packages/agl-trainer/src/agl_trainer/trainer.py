"""``AglRayPPOTrainer``: verl's ``RayPPOTrainer`` with rollouts collected from real agents.

verl keeps the optimiser, FSDP, KL, the critic, checkpointing and the worker RPCs; what changes is
where a step's data comes from: rollouts queued on agl-server and run by agents anywhere, their
``model_request`` events turned into training rows by agl-adapter, with agl-algos' rollout-level
advantage and per-rollout losses. :meth:`AglRayPPOTrainer.fit` is the loop and
:meth:`AglRayPPOTrainer.train_step` the step, stage by stage (the modules of :mod:`agl_trainer.step`,
then :mod:`agl_trainer.serving.publisher`); each stage takes the batch and its settings and returns
the batch and its metrics.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
from tqdm import tqdm
from verl import DataProto
from verl.single_controller.ray import RayWorkerGroup
from verl.trainer.ppo.metric_utils import compute_timing_metrics
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.trainer.ppo.utils import Role
from verl.utils.debug import marked_timer
from verl.utils.metric import reduce_metrics
from verl.utils.tracking import Tracking

from agl_adapter import EmptyBatchError
from agl_rollout import AglClient, BatchTopUp
from agl_rollout.orphans import cancel_orphans
from agl_trainer.datasets import collate_rows
from agl_trainer.errors import TooManyEmptySteps
from agl_trainer.run_state import RunState
from agl_trainer.serving.drain import Drain
from agl_trainer.serving.fleet import Fleet
from agl_trainer.serving.publisher import Publisher
from agl_trainer.serving.replicas import VerlReplicas
from agl_trainer.serving.weights import WeightPusher
from agl_trainer.settings import MAX_EMPTY_STEPS_KEY, Settings, replica_config
from agl_trainer.step.advantages import compute_advantages, kl_controller
from agl_trainer.step.batching import cut_batch
from agl_trainer.step.collection import Collection
from agl_trainer.step.correction import compute_old_log_probs
from agl_trainer.step.overlong import shape_overlong
from agl_trainer.step.rollout_normalization import normalize_by_rollout
from agl_trainer.terminal import terminal
from agl_trainer.verl_glue.workers import AglActorRefWorker, PolicyWorkers, build_policy_workers
from agl_types import CompletedRollout, RolloutState

if TYPE_CHECKING:
    from omegaconf import DictConfig

logger = logging.getLogger(__name__)

_B = TypeVar("_B")


class AglRayPPOTrainer(RayPPOTrainer):
    """GRPO on agent rollouts; see the module docstring.

    Agents reach the inference servers through the gateway: the ones in
    ``agentlightning.external_servers.endpoints``, to which ``weight_pusher`` gives the actor's
    weights after each update; or, with that list empty, verl's own vLLM replicas, which
    :meth:`init_workers` starts and which then push for themselves (:mod:`agl_trainer.serving.replicas`).
    ``processor`` is the model's HF processor (None for a text model): each model call's images are
    then fetched with it and encoded into the batch. ``config`` must already be configured for
    ``settings`` (:func:`agl_trainer.settings.configure_verl`).
    """

    def __init__(
        self,
        config: DictConfig,
        settings: Settings,
        tokenizer: Any,
        *,
        train_dataset: Any,
        val_dataset: Any,
        weight_pusher: WeightPusher,
        processor: Any | None = None,
    ) -> None:
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
        self.settings = settings
        self.client = AglClient(settings.server.base_url, settings.server.key, run_id=uuid.uuid4().hex)
        """Its ``run_id`` tags every rollout of this process: a run resumed from its checkpoint cancels its strays."""
        self.weight_version = 0
        """Published actor updates: a step that updates nothing (empty batch, critic warm-up) ages no group."""
        self._drain = Drain.from_settings(settings.server.drain)
        self.collection = Collection(
            self.client,
            settings.pipeline,
            top_up=BatchTopUp(lambda: iter(self.train_dataloader)),
            drain=self._drain,
            include_images=processor is not None,
            served_adapter_prefix=weight_pusher.served_adapter_prefix,
            include_endpoints=bool(settings.server.endpoints),
        )
        self.adapter = settings.adapter.build(tokenizer, processor)
        self.kl_ctrl = kl_controller(settings.advantages)
        self._rng = np.random.default_rng(settings.batch.seed)
        self._weight_pusher = weight_pusher
        self.policy_workers: PolicyWorkers | None = None
        self.replicas: VerlReplicas | None = None
        self._publisher: Publisher | None = None
        self._fleet: Fleet | None = None

    def init_workers(self) -> None:
        """Build verl's actor (and ref, critic) workers, verl's vLLM replicas unless the servers are
        external, and the publisher that serves the actor's weights to them."""
        server = self.settings.server
        workers = build_policy_workers(
            self.config,
            use_reference_policy=self.use_reference_policy,
            use_critic=self.use_critic,
            with_rollout=server.uses_verl_replicas,
        )
        self.policy_workers = workers
        self.actor_rollout_wg = workers.actor
        if workers.ref is not None:
            self.ref_policy_wg = workers.ref
        if workers.critic is not None:
            self.critic_wg = workers.critic
        self.distillation_config = None  # pyright: ignore[reportAttributeAccessIssue]  (no distillation)
        workers.check_policy_loss(str(self.config.actor_rollout_ref.actor.policy_loss.loss_mode))
        pusher, endpoints = self._weight_pusher, server.endpoints
        fleet: Fleet | None = None
        if server.uses_verl_replicas:
            self.replicas = VerlReplicas.start(replica_config(self.config), workers)
            pusher, endpoints = self.replicas, tuple(self.replicas.addresses)
        elif hasattr(pusher, "endpoints"):  # a pusher to external servers: watch them
            catch_up = getattr(pusher, "catch_up", None)
            fleet = Fleet(
                self.client, endpoints, model_name=server.model_name, route=pusher.route, catch_up=catch_up
            )
            self.collection.rerun = fleet.reruns
            self._fleet = fleet.start()
        self._publisher = Publisher(
            self.client,
            pusher,
            model_name=server.model_name,
            endpoints=endpoints,
            resume=self.settings.pipeline.admission.overlap,
            drain=self._drain,
            fleet=fleet,
        )

    def shutdown(self) -> None:
        """Stop the collector, the server watcher, the replicas and workers and close the server
        client; Ray itself stays up."""
        self.collection.stop()
        if self._fleet is not None:
            self._fleet.stop()
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

    @property
    def publisher(self) -> Publisher:
        if self._publisher is None:
            raise RuntimeError("init_workers() has not been called")
        return self._publisher

    def fit(self) -> None:
        """verl's loop: resume, publish, validate first (optional), then steps; validate and save on
        schedule, always at the last step, also after a step that trained nothing (the reference skips
        all three for such a step). ``agentlightning.max_empty_steps`` empty steps in a row stop the run."""
        loop = self.settings.loop
        tracker = Tracking(loop.project_name, loop.experiment_name, list(loop.loggers), config=None)
        progress: tqdm[Any] | None = None
        try:
            self.global_steps = 0
            self._load_checkpoint()
            self.publisher.publish(self.workers, self.weight_version)
            if loop.val_before_train:
                tracker.log(data=self.validate(), step=self.global_steps)
                if loop.val_only:
                    return
            self.collection.start(steps_done=self.global_steps)
            progress = tqdm(
                total=self.total_training_steps,
                initial=self.global_steps,
                desc="Training Progress",
                file=terminal().err,
            )
            empty_steps = 0
            self.global_steps += 1
            while self.global_steps <= self.total_training_steps:
                step, is_last = self.global_steps, self.global_steps == self.total_training_steps
                timing: dict[str, float] = {}
                with marked_timer("step", timing):
                    metrics = self.train_step(timing)
                if loop.validates_at(step, is_last):
                    with marked_timer("testing", timing):
                        metrics.update(self.validate())
                if loop.saves_at(step, is_last):
                    with marked_timer("save_checkpoint", timing):
                        self._save_checkpoint()
                self.collection.step_done()
                metrics.update({f"timing_s/{name}": seconds for name, seconds in timing.items()})
                tracker.log(data=metrics, step=step)
                progress.update(1)
                empty_steps = 0 if metrics.get("training/n_sample_trained") else empty_steps + 1
                if loop.max_empty_steps is not None and empty_steps >= loop.max_empty_steps:
                    raise TooManyEmptySteps(
                        f"{empty_steps} steps in a row trained nothing (the last, step {step}: see the warnings "
                        f"above); stopping ({MAX_EMPTY_STEPS_KEY}={loop.max_empty_steps}, null never stops)"
                    )
                self.global_steps += 1
        except BaseException:
            tracker.finish(exit_code=1)
            raise
        finally:
            if progress is not None:
                progress.close()  # ends the bar's line: what is printed next (Ctrl-C's line) starts its own
            self.collection.stop()
        tracker.finish(exit_code=0)

    def train_step(self, timing: dict[str, float]) -> dict[str, Any]:
        """One step, its stages in order; returns its metrics. A batch left with no trainable row
        ends the step early (``training/n_sample_trained`` 0, the log says why)."""
        settings, step = self.settings, self.global_steps
        metrics: dict[str, Any] = {"timing/step_start_wall": time.time(), "training/n_sample_trained": 0}
        rollouts = _stage("gen", timing, metrics, self.collection.take, step, self.weight_version)
        metrics.update(self.publisher.serving_metrics(rollouts))
        batch = _stage("adapter", timing, metrics, self._rows, rollouts)
        if batch is not None and settings.overlong is not None:
            batch = _stage("overlong", timing, metrics, shape_overlong, batch, settings.overlong)
        if batch is not None:
            batch = _stage("cut", timing, metrics, cut_batch, batch, settings.batch, rng=self._rng, step=step)
        if batch is None:
            return metrics
        if settings.batch.balance:
            self._balance_batch(batch, metrics=metrics)
        self.publisher.pusher.release()
        batch = _stage(
            "old_log_prob", timing, metrics, compute_old_log_probs, batch, settings.correction,
            recompute=self.workers.compute_log_prob,
        )  # fmt: skip
        if self.use_reference_policy:
            with marked_timer("ref", timing):
                batch = batch.union(self.workers.compute_ref_log_prob(batch))
        if self.use_critic:
            with marked_timer("values", timing):
                batch = batch.union(self.workers.compute_values(batch))
        batch = _stage(
            "adv", timing, metrics, compute_advantages, batch, settings.advantages, kl_ctrl=self.kl_ctrl
        )
        batch = _stage("adv", timing, metrics, normalize_by_rollout, batch, settings.normalization)
        if self.use_critic:
            with marked_timer("update_critic", timing):
                metrics.update(reduce_metrics(self.workers.update_critic(batch)))
        if settings.loop.critic_warmup <= step:
            with marked_timer("update_actor", timing):
                metrics.update(reduce_metrics(self.workers.update_actor(batch)))
            self.weight_version += 1
        with marked_timer("update_weights", timing):
            metrics.update(self.publisher.publish(self.workers, self.weight_version))
        metrics.update(compute_timing_metrics(batch=batch, timing_raw=timing))
        return metrics

    def _rows(self, rollouts: list[CompletedRollout]) -> tuple[DataProto | None, dict[str, Any]]:
        """Stage 2: the adapter's training rows of ``rollouts`` (None, with a warning, when there are none)."""
        failed = [r for r in rollouts if r.rollout_state == RolloutState.FAILED]
        if rollouts and len(failed) == len(rollouts):
            logger.warning(
                "step %d: all %d rollouts failed; the first error: %s",
                self.global_steps,
                len(rollouts),
                failed[0].error_message or ("timed out" if failed[0].timed_out else "none reported"),
            )
        try:
            built, metrics = self.adapter.build_batch(rollouts, global_steps=self.global_steps)
        except EmptyBatchError as err:
            logger.warning("step %d has no training rows: %s", self.global_steps, err)
            return None, {}
        return built.to_data_proto(), metrics

    def validate(self) -> dict[str, float]:
        """Run every validation batch through the rollout path; metrics over all of them at once."""
        completed, drain = self.collection.val_rollouts(self.val_dataloader, self.global_steps)
        return {**self.adapter.get_test_metrics(completed, global_steps=self.global_steps), **drain}

    def _save_checkpoint(self) -> None:
        """agl's state first, then verl's (whose marker file names the newest checkpoint), with no
        sample drawn in between: the held groups and verl's dataloader state agree."""
        with self.collection.admission_held():
            state = RunState(
                self.weight_version,
                self.collection.state(),
                self.collection.top_up.leftover_rows(),
                run_id=self.client.run_id,
            )
            state.save(self.settings.loop.checkpoint_dir, self.global_steps)
            super()._save_checkpoint()

    def _load_checkpoint(self) -> Any:
        """verl's resume, then agl's state and the loader's from the same folder; the rollouts the
        dead run left on agl-server beyond the checkpoint's held groups are cancelled."""
        result = super()._load_checkpoint()
        folder = self._resumed_folder()
        if folder is None:
            return result
        state = RunState.load(folder, self.global_steps)
        self._restore_loader(folder)
        if state is None:
            self.weight_version = self.global_steps  # a checkpoint of verl alone: one update per step
            return result
        self.weight_version = state.weight_version
        self.collection.restore(state.async_state, state.leftover_samples)
        if state.run_id is not None:
            held = state.async_state.groups if state.async_state is not None else []
            n_cancelled = cancel_orphans(
                self.client, state.run_id, keep={rollout_id for group in held for rollout_id in group.pending}
            )
            if n_cancelled:
                logger.info(
                    "cancelled %d rollouts the dead run left on agl-server after its checkpoint", n_cancelled
                )
        return result

    def _resumed_folder(self) -> Path | None:
        """The checkpoint folder verl resumed from (None: a fresh run): ``trainer.resume_from_path``
        under ``trainer.resume_mode=resume_path``, else the newest under ``trainer.default_local_dir``."""
        if not self.global_steps:
            return None
        trainer = self.config.trainer
        if trainer.resume_mode == "resume_path":
            return Path(str(trainer.resume_from_path)).absolute()
        return self.settings.loop.checkpoint_dir / f"global_step_{self.global_steps}"

    def _restore_loader(self, folder: Path) -> None:
        """The loader's state saved in ``folder``. verl skips it at a step that is a multiple of the
        epoch length, where its own loader has just run out; agl's runs ahead of the steps, so it is
        mid-epoch there too, and a fresh loader would replay epoch 1's order."""
        path = folder / "data.pt"
        if path.exists():
            self.train_dataloader.load_state_dict(torch.load(path, weights_only=False))


def _stage(
    name: str,
    timing: dict[str, float],
    metrics: dict[str, Any],
    stage: Callable[..., tuple[_B, dict[str, Any]]],
    *args: Any,
    **kwargs: Any,
) -> _B:
    """Run ``stage`` under verl's timer ``name`` and merge its metrics into the step's."""
    with marked_timer(name, timing):
        batch, stage_metrics = stage(*args, **kwargs)
    metrics.update(stage_metrics)
    return batch


__all__ = ("AglRayPPOTrainer",)
