"""Stage 1: where a step's rollouts come from: one :class:`~agl_rollout.GroupCollector` in every mode.

The three modes are three admission rules (:class:`agl_rollout.Admission`, chosen by
:mod:`agl_trainer.settings.pipeline`) and one difference in the gateway:

- sync: one step's generation batch starts once the previous step is over (staleness bound 0);
- async (carry-over): more groups run than a step trains; the rest carry over to the next step,
  under the staleness bound K;
- fully async: groups keep running through the update, up to the staleness bound K.

In the first two the gateway is open only while the trainer waits (for a step's groups, or for
validation) and is paused and drained after it, so no model call is in flight while the actor
trains; in the fully-async mode it stays open and :mod:`agl_trainer.serving.publisher` pauses it only
around the reload.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Generator, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

from agl_rollout import (
    AglClient,
    AglServerError,
    AsyncRolloutManager,
    AsyncRolloutState,
    BatchTopUp,
    CarriedGroup,
    GroupCollector,
    HookRunner,
    RetryPolicy,
    SyncRolloutManager,
    load_hooks,
)
from agl_rollout.collector import CANCEL_REASON
from agl_trainer.interrupts import ctrl_c_held
from agl_trainer.serving.drain import Drain
from agl_trainer.settings import PipelineSettings
from agl_trainer.step.dynamic_sampling import dynamic_sampling_metrics, keeps_group, max_groups_examined
from agl_types import CompletedRollout

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

STOP_RETRY = RetryPolicy(max_attempts=2, base_delay_s=0.05, max_delay_s=0.05, deadline_s=1.0)
"""How calls to agl-server are retried once the collection stops: its clean-up is best effort, and
under the usual policy a server that is gone (the embedded default's agl-server died) would cost
about 16 s a call, for every rollout still pending: minutes before the run ends."""


class Collection:
    """The rollout side of the trainer: a step's groups, validation rollouts, checkpoint state.

    Life cycle: :meth:`start` (the collector, carrying a checkpoint's groups on), per step
    :meth:`take` then :meth:`step_done`, :meth:`val_rollouts` whenever the trainer validates,
    :meth:`stop` at the end, on every exit path; :meth:`state` and :meth:`admission_held` for
    checkpoints. The hooks' ``on_startup`` runs once, before the first rollout of either kind, and
    no two hook calls overlap.
    """

    def __init__(
        self,
        client: AglClient,
        settings: PipelineSettings,
        *,
        top_up: BatchTopUp,
        drain: Drain,
        include_images: bool = False,
        served_adapter_prefix: str | None = None,
        include_endpoints: bool = False,
    ) -> None:
        """``include_images``: read each model call's images (a vision-language model's run);
        ``served_adapter_prefix``: record each call at the version of the adapter that answered it
        (the weight pusher's); ``include_endpoints``: record the endpoint that served each call (several
        external servers: per-server metrics)."""
        self.client = client
        self.settings = settings
        self.top_up = top_up
        self.drain = drain
        self._manager_config = replace(
            settings.manager,
            include_images=include_images,
            served_adapter_prefix=served_adapter_prefix,
            include_endpoints=include_endpoints,
        )
        hooks = load_hooks(settings.hooks) if settings.hooks else None
        # Validation (main thread) and the collector (its thread) run the one hooks object, one call
        # at a time; each runner counts its own errors.
        lock = threading.Lock()
        self._train_hooks = HookRunner(hooks, client, lock=lock)
        self.val_manager = SyncRolloutManager(
            client, self._manager_config, hooks=HookRunner(hooks, client, lock=lock)
        )
        self.collector: GroupCollector | None = None
        self._restored: AsyncRolloutState | None = None
        self._started_hooks = False
        self._stopped = False
        self.rerun: Callable[[CarriedGroup], bool] | None = None
        """Which complete groups to run again (a server died under them); see :meth:`GroupCollector.take`."""

    def restore(self, state: AsyncRolloutState | None, leftover_samples: Sequence[dict[str, Any]]) -> None:
        """Carry a checkpoint's held groups and cut-off loader samples on (before :meth:`start`)."""
        self._restored = state
        self.top_up.restore_leftover(leftover_samples)

    def start(self, steps_done: int) -> None:
        """Start admitting groups (``steps_done``: steps already trained), after the hooks'
        ``on_startup`` unless a validation ran it."""
        self._startup_hooks()
        manager = AsyncRolloutManager(
            self.client,
            self._manager_config,
            train_batch_size=self.settings.train_batch_size,
            async_train_batch_size=self.settings.admission.max_groups,
            hooks=self._train_hooks,
            state=self._restored,
        )
        self._open_gateway_for_admission()
        self.collector = GroupCollector(
            manager,
            self.top_up.next_batch,
            self.settings.gate,
            admission=self.settings.admission,
            steps_done=steps_done,
        ).start()

    def stop(self) -> None:
        """Stop the collector, cancel the rollouts it or an interrupted validation still has on the
        server, and leave the gateway open (what the collector held stays in :meth:`state` for a
        checkpoint taken before), whether or not collection started. From here on the client
        retries under :data:`STOP_RETRY`, so the clean-up is short; a Ctrl-C during it is held
        until it is done, then raised (a further one is not held)."""
        if self._stopped:
            return
        self._stopped = True
        with ctrl_c_held():
            # A retry the collector's thread is in ends at its next try (max_attempts and the deadline
            # are read at every try; the delay it is sleeping was drawn from the old policy).
            self.client.retry = STOP_RETRY
            n_cancelled = self.collector.stop(cancel=True) if self.collector is not None else 0
            n_cancelled += self.val_manager.cancel_pending(CANCEL_REASON)
            if n_cancelled:
                logger.info("cancelled %d rollouts still in flight on agl-server", n_cancelled)
            try:
                self.client.resume()
            except AglServerError as exc:
                logger.warning("could not resume the gateway at the end of the run: %s", exc)

    def state(self) -> AsyncRolloutState:
        """Every group held now (a checkpoint's copy)."""
        if self.collector is None:
            return self._restored or AsyncRolloutState()
        return self.collector.state

    @contextmanager
    def admission_held(self) -> Generator[None]:
        """No sample is drawn from the loader inside the block."""
        if self.collector is None:
            yield
            return
        with self.collector.admission_held():
            yield

    def take(self, step: int, trained_version: int) -> tuple[list[CompletedRollout], dict[str, float]]:
        """The step's completed rollouts (GRPO siblings adjacent), through dynamic sampling when it
        is on, and the collection's metrics."""
        if self.collector is None:
            raise RuntimeError("Collection.start() has not been called")
        collector = self.collector
        sampling = self.settings.dynamic_sampling
        keep = partial(keeps_group, settings=sampling) if sampling else None
        max_examined = (
            max_groups_examined(sampling, self.settings.admission.groups_per_step) if sampling else None
        )
        requests_before = self.client.request_count
        collected, drain = self._with_gateway_open(
            step,
            lambda: collector.take(
                trained_version,
                timeout_s=self.settings.take_timeout_s,
                keep=keep,
                max_examined=max_examined,
                rerun=self.rerun,
            ),
        )
        metrics = {
            **collected.metrics,
            **drain,
            "training/server_requests_per_rollout": (self.client.request_count - requests_before)
            / max(len(collected.rollouts), 1),
        }
        if sampling is not None:
            metrics |= dynamic_sampling_metrics(
                collected,
                sampling,
                gen_batch_size=self.settings.admission.groups_per_step,
                train_batch_size=self.settings.train_batch_size,
                step=step,
            )
        return collected.rollouts, metrics

    def step_done(self) -> None:
        """The step is over: open the gateway (sync modes) and admit the next step's groups."""
        self._open_gateway_for_admission()
        if self.collector is not None:
            self.collector.step_done()

    def val_rollouts(
        self, batches: Iterable[Any], step: int
    ) -> tuple[list[CompletedRollout], dict[str, float]]:
        """Every validation batch, each waited for whole, and the last wait's drain metrics under
        ``val/``; the hooks' ``on_startup`` first, when nothing ran it yet."""
        self._startup_hooks()
        completed: list[CompletedRollout] = []
        drain: dict[str, float] = {}
        for batch in batches:
            result, drain = self._with_gateway_open(
                step,
                lambda batch=batch: self.val_manager.enqueue_and_wait_until_completed(
                    batch, is_train=False, step=step
                ),
            )
            completed.extend(result.completed)
            drain = {**result.metrics, **drain}
        return completed, {key.replace("training/", "val/", 1): value for key, value in drain.items()}

    def _startup_hooks(self) -> None:
        """The hooks' ``on_startup``, once, before the run's first rollout of any kind."""
        if not self._started_hooks:
            self._started_hooks = True
            self._train_hooks.startup()

    def _open_gateway_for_admission(self) -> None:
        """In the sync modes, resume the gateway before groups are admitted: an agent that found it
        paused would wait out the drain's Retry-After (5 s) before its first call."""
        if not self.settings.admission.overlap:
            self.client.resume()

    def _with_gateway_open(self, step: int, wait: Callable[[], _T]) -> tuple[_T, dict[str, float]]:
        """``wait``; in the sync modes with the gateway resumed for it, then paused and drained, so
        no model call spans the weight change that follows."""
        if self.settings.admission.overlap:
            return wait(), {}
        self.client.resume()
        result = wait()
        return result, self.drain(self.client, f"rollout_done step={step}")


__all__ = ("Collection",)
