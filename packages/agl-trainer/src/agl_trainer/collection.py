"""Pipeline stage 1: where a step's rollouts come from, in each of the three modes.

- sync: the step's batch is enqueued and waited for whole;
- async (carry-over): ``async_train_batch_size`` groups in flight, the first complete
  ``train_batch_size`` trained, the rest carried over;
- fully async: a :class:`~agl_rollout.GroupCollector` thread keeps groups running through the
  update; the step takes fresh complete groups through the staleness gate.

In the first two the gateway is resumed for the wait and paused and drained after it, so no
model call is in flight while the weights change; in the fully-async mode it stays open and
:mod:`agl_trainer.publisher` pauses it only around the reload.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from omegaconf import DictConfig

from agl_rollout import (
    AglClient,
    AsyncRolloutManager,
    AsyncRolloutState,
    BatchTopUp,
    GroupCollector,
    RolloutHooks,
    RolloutManagerConfig,
    StalenessGate,
    SyncRolloutManager,
    load_hooks,
    model_registrations,
)
from agl_trainer.dynamic_sampling import DynamicSampling
from agl_trainer.settings import AglSettings
from agl_types import CompletedRollout, ModelRegistration

Registrations = Callable[[], list[ModelRegistration]]


class Collection:
    """The rollout side of the trainer: train rollouts per step, validation rollouts, checkpoint state.

    ``registrations()`` gives the gateway's model registrations for the current weight version
    (the sync modes register them before every wait; the fully-async publisher after every push).
    """

    def __init__(
        self,
        client: AglClient,
        settings: AglSettings,
        manager_config: RolloutManagerConfig,
        *,
        train_batch_size: int,
        gen_batch_size: int,
        top_up: BatchTopUp,
        registrations: Registrations,
        hooks: RolloutHooks | None,
        dynamic_sampling: DynamicSampling | None = None,
    ) -> None:
        self.client = client
        self.settings = settings
        self.train_batch_size = train_batch_size
        self.gen_batch_size = gen_batch_size
        self.dynamic_sampling = dynamic_sampling
        self._top_up = top_up
        self._registrations = registrations
        self._hooks = hooks
        self._manager_config = manager_config
        self.sync_manager = SyncRolloutManager(client, manager_config, hooks=hooks)
        self.async_manager: AsyncRolloutManager | None = None
        if settings.async_enabled or settings.fully_async:
            self.async_manager = self._async_manager(None)
        self.collector: GroupCollector | None = None

    @classmethod
    def from_config(
        cls,
        config: DictConfig,
        settings: AglSettings,
        client: AglClient,
        top_up: BatchTopUp,
        registrations: Registrations,
        *,
        include_images: bool = False,
    ) -> Collection:
        """The collection ``config`` describes: the managers' settings, batch sizes, hooks and
        dynamic sampling; ``include_images`` reads each model call's images (a vision-language model)."""
        data = config.data
        return cls(
            client,
            settings,
            RolloutManagerConfig(
                train_rollout_n=int(config.actor_rollout_ref.rollout.n),
                rollout_timeout_seconds=settings.rollout_timeout_seconds,
                poll_interval_seconds=settings.poll_interval_seconds,
                max_poll_interval_seconds=settings.max_poll_interval_seconds,
                local_agent_class=settings.local_agent_class,
                local_env_map=settings.local_env_map,
                k8s_job_template_path=settings.k8s_job_template_path,
                include_routed_experts=settings.routing_replay_key is not None,
                include_images=include_images,
            ),
            train_batch_size=int(data.train_batch_size),
            gen_batch_size=int(data.get("gen_batch_size") or data.train_batch_size),
            top_up=top_up,
            registrations=registrations,
            hooks=load_hooks(settings.hooks) if settings.hooks else None,
            dynamic_sampling=DynamicSampling.from_config(config, settings),
        )

    @property
    def fully_async(self) -> bool:
        return self.settings.fully_async

    def _async_manager(self, state: AsyncRolloutState | None) -> AsyncRolloutManager:
        return AsyncRolloutManager(
            self.client,
            self._manager_config,
            train_batch_size=self.train_batch_size,
            async_train_batch_size=self._groups_in_flight(),
            hooks=self._hooks,
            state=state,
        )

    def _groups_in_flight(self) -> int:
        groups = self.settings.groups_in_flight(self.train_batch_size)
        if not self.fully_async:
            return groups
        # The manager holds more than one step's groups; the collector's admission rule caps it at
        # (K + 1) x train_batch_size, which for K=0 is exactly one step's.
        return max(groups, self.train_batch_size + 1)

    # -- life cycle ------------------------------------------------------------------------------

    def start(self, steps_done: int) -> None:
        """Fully async: open the gateway with the current registrations and start the collector."""
        if not self.fully_async:
            return
        assert self.async_manager is not None
        self.client.register_models(self._registrations())
        self.client.resume()
        gate = StalenessGate(self.settings.max_staleness, self.settings.stale_strategy)  # pyright: ignore[reportArgumentType]  (validated)
        self.collector = GroupCollector(
            self.async_manager, self._top_up.next_batch, gate, steps_done=steps_done
        ).start()

    def stop(self) -> None:
        """Stop the collector; what it holds stays in :meth:`state` for a checkpoint."""
        if self.collector is not None:
            self.collector.stop()

    def state(self) -> AsyncRolloutState | None:
        """The async modes' held groups (for checkpoints); None in sync mode."""
        if self.collector is not None:
            return self.collector.state
        return self.async_manager.state if self.async_manager is not None else None

    def restore(self, state: AsyncRolloutState) -> None:
        """Carry a checkpoint's held groups on (before :meth:`start`)."""
        if self.async_manager is not None:
            self.async_manager = self._async_manager(state)

    # -- per step --------------------------------------------------------------------------------

    def train_rollouts(
        self, step: int, trained_version: int
    ) -> tuple[list[CompletedRollout], dict[str, float]]:
        """The step's completed rollouts (GRPO siblings adjacent) and the collection's metrics,
        through dynamic sampling when it is on."""
        if self.dynamic_sampling is None:
            return self._generation_batch(step, trained_version)
        return self.dynamic_sampling.collect(
            lambda: self._generation_batch(step, trained_version), self.train_batch_size, step
        )

    def _generation_batch(
        self, step: int, trained_version: int
    ) -> tuple[list[CompletedRollout], dict[str, float]]:
        if self.collector is not None:
            timeout_s = 2 * self.settings.rollout_timeout_seconds + self.settings.drain_timeout_seconds
            collected = self.collector.take(trained_version, timeout_s=timeout_s)
            return collected.rollouts, collected.metrics
        if self.async_manager is not None:
            shortfall = self.async_manager.shortfall()
            batch = self._top_up.next_batch(shortfall) if shortfall else {}
            return self._drained(
                step,
                lambda: self.async_manager.enqueue_and_wait_until_group_completed(  # pyright: ignore[reportOptionalMemberAccess]
                    batch, step=step, models=self._registrations()
                ),
            )
        batch = self._top_up.next_batch(self.gen_batch_size)
        return self._drained(
            step,
            lambda: self.sync_manager.enqueue_and_wait_until_completed(
                batch, is_train=True, step=step, models=self._registrations()
            ),
        )

    def step_published(self) -> None:
        """The step's weights are served: the fully-async collector may admit the next groups."""
        if self.collector is not None:
            self.collector.step_done()

    def val_rollouts(
        self, batches: Iterable[Any], step: int
    ) -> tuple[list[CompletedRollout], dict[str, float]]:
        """Every validation batch, each waited for whole (the fully-async mode leaves the gateway
        open), and the last wait's drain metrics under ``val/``."""
        completed: list[CompletedRollout] = []
        drain: dict[str, float] = {}
        for batch in batches:
            if self.fully_async:
                result = self.sync_manager.enqueue_and_wait_until_completed(batch, is_train=False, step=step)
                rollouts, drain = result.completed, result.metrics
            else:
                rollouts, drain = self._drained(
                    step,
                    lambda batch=batch: self.sync_manager.enqueue_and_wait_until_completed(
                        batch, is_train=False, step=step, models=self._registrations()
                    ),
                )
            completed.extend(rollouts)
        return completed, {key.replace("training/", "val/", 1): value for key, value in drain.items()}

    def _drained(self, step: int, wait: Callable[[], Any]) -> tuple[list[CompletedRollout], dict[str, float]]:
        """Resume the gateway, ``wait``, then pause and drain it: no model call spans a weight change."""
        requests_before = self.client.request_count
        self.client.resume()
        result = wait()
        drain = self.settings.drain(self.client, f"rollout_done step={step}")
        requests = {
            "training/server_requests_per_rollout": (self.client.request_count - requests_before)
            / max(len(result.completed), 1)
        }
        return result.completed, {**result.metrics, **drain, **requests}


def registrations_for(model: str, endpoints: Sequence[str], version: Callable[[], int]) -> Registrations:
    """The gateway registrations of ``model`` on ``endpoints`` at the weight version ``version()``."""
    return lambda: model_registrations(model, endpoints, version=version())


__all__ = ("Collection", "Registrations", "registrations_for")
