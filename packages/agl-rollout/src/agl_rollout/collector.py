"""The fully-async mode's producer: a thread that keeps GRPO groups in flight while the trainer trains.

The collector owns an :class:`AsyncRolloutManager`. Its thread tops the held groups up and polls
the server every ``poll_interval_seconds``, whatever the trainer is doing; the trainer calls
:meth:`GroupCollector.take` for a step's groups (blocking only while fewer than
``train_batch_size`` fresh complete groups are held) and :meth:`GroupCollector.step_done` once
the step's weights are published.

Admission follows the staleness bound K (AReaL's rule): at most ``(K + 1) * train_batch_size``
groups are held between steps, ``K * train_batch_size`` while a taken step is still training,
and never more than ``max_groups``. With K=0 no group starts before the weights it will be
trained against are published, so training is on-policy; with K>=1 collection overlaps the
update. The bound on admission is not an age guarantee (a slow group can outlive it), so
:meth:`take` also passes complete groups through the :class:`StalenessGate`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from agl_rollout._tracker import WaitCounts
from agl_rollout.async_manager import AsyncRolloutManager, AsyncRolloutState, CarriedGroup
from agl_rollout.batch import Batch
from agl_rollout.lifecycle import lifecycle_metrics
from agl_rollout.staleness import StalenessGate, group_age
from agl_types import CompletedRollout

logger = logging.getLogger("agl_rollout.collector")


class CollectorError(RuntimeError):
    """The collector's thread failed; raised by :meth:`GroupCollector.take` with the cause chained."""


@dataclass(frozen=True)
class CollectedGroups:
    """One step's groups (members adjacent, oldest group first) and the collection's metrics."""

    groups: list[CarriedGroup]
    metrics: dict[str, float] = field(default_factory=dict[str, float])

    @property
    def rollouts(self) -> list[CompletedRollout]:
        return [rollout for group in self.groups for rollout in group.completed]


class GroupCollector:
    """Streams complete groups from agl-server in a background thread; see the module docstring.

    ``next_samples(k)`` returns the next ``k`` samples of the training data (called from the
    collector's thread only). ``steps_done`` is the number of steps already trained (a resumed run's
    global step), so new groups are labelled with the step that will train them.
    """

    def __init__(
        self,
        manager: AsyncRolloutManager,
        next_samples: Callable[[int], Batch],
        gate: StalenessGate,
        *,
        steps_done: int = 0,
    ) -> None:
        self.manager = manager
        self.gate = gate
        self.train_batch_size = manager.train_batch_size
        self.max_groups = manager.async_train_batch_size
        self._next_samples = next_samples
        self._steps_done = steps_done
        self._open_steps = 0
        self._counts = WaitCounts()
        self._n_hook_errors = manager.hooks.n_errors
        self._n_recreated = 0
        self.n_polls = 0
        """Sweeps the thread has finished (the trainer's clock of collection progress)."""
        self._error: BaseException | None = None
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agl-collector", daemon=True)

    # -- life cycle ---------------------------------------------------------------------------

    def start(self) -> GroupCollector:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop topping up and polling; held groups stay in :meth:`state` (rollouts on the server run on)."""
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> GroupCollector:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def state(self) -> AsyncRolloutState:
        """A consistent copy of the held groups, for checkpoints (take it between steps)."""
        with self._lock:
            return self.manager.state

    # -- the trainer's side -------------------------------------------------------------------

    def take(self, trained_version: int, *, timeout_s: float) -> CollectedGroups:
        """Block until ``train_batch_size`` fresh complete groups are held and hand them over.

        ``trained_version`` is the weight version the step trains (its groups' ages are measured
        against it). Over-age complete groups met meanwhile are dropped or requeued as the gate
        says. Raises :class:`CollectorError` when the thread failed and ``TimeoutError`` after
        ``timeout_s`` without enough groups.
        """
        started = time.monotonic()
        dropped = requeued = 0
        with self._lock:
            while True:
                if self._error is not None:
                    raise CollectorError(f"the rollout collector failed: {self._error!r}") from self._error
                stale_dropped, stale_requeued = self._gate_complete(trained_version)
                dropped, requeued = dropped + stale_dropped, requeued + stale_requeued
                fresh = self.manager.complete_groups()[: self.train_batch_size]
                if len(fresh) == self.train_batch_size:
                    break
                waited = time.monotonic() - started
                if waited >= timeout_s:
                    raise TimeoutError(
                        f"the collector holds {len(fresh)} of train_batch_size={self.train_batch_size} complete "
                        f"groups after {waited:.0f} s ({self.manager.n_pending_rollouts} rollouts pending); "
                        "check the agents, or raise the take timeout"
                    )
                self._lock.wait(min(timeout_s - waited, 1.0))
            self.manager.release(fresh)
            self._open_steps += 1
            metrics = self._take_metrics(fresh, trained_version, time.monotonic() - started)
            self._lock.notify_all()
        metrics["training/async/dropped_stale"] = float(dropped)
        metrics["training/async/requeued_stale"] = float(requeued)
        return CollectedGroups(groups=fresh, metrics=metrics)

    def wait_polls(self, n: int, *, timeout_s: float) -> None:
        """Block until the thread has finished ``n`` more sweeps (``TimeoutError`` after ``timeout_s``)."""
        with self._lock:
            target = self.n_polls + n
        self._wait(lambda: self.n_polls >= target, f"{n} more sweeps", timeout_s)

    def wait_complete(self, n_groups: int, *, timeout_s: float) -> None:
        """Block until at least ``n_groups`` complete groups are held (``TimeoutError`` after ``timeout_s``)."""
        self._wait(lambda: self.manager.n_complete >= n_groups, f"{n_groups} complete groups", timeout_s)

    def _wait(self, done: Callable[[], bool], what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not done():
                if self._error is not None:
                    raise CollectorError(f"the rollout collector failed: {self._error!r}") from self._error
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"the collector did not reach {what} within {timeout_s} s")
                self._lock.wait(remaining)

    def step_done(self) -> None:
        """The taken step's weights are published: admit the groups its bound now allows."""
        with self._lock:
            self._open_steps = max(0, self._open_steps - 1)
            self._steps_done += 1
            self._lock.notify_all()

    # -- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with self._lock:
                self._n_recreated += self.manager.recreate_lost_after_resume()
            while not self._stop.is_set():
                with self._lock:
                    self._top_up()
                    self.manager.poll(self._counts)
                    self.n_polls += 1
                    self._lock.notify_all()
                self._stop.wait(self.manager.config.poll_interval_seconds)
        except BaseException as exc:  # handed to the trainer by take(), never swallowed
            logger.exception("rollout collector stopped on an error")
            with self._lock:
                self._error = exc
                self._lock.notify_all()

    def _admission_limit(self) -> int:
        """How many groups may be held now (see the module docstring)."""
        bound = self.gate.max_staleness
        if bound is None:
            return self.max_groups
        return max(0, min(self.max_groups, (bound + 1 - self._open_steps) * self.train_batch_size))

    def _top_up(self) -> None:
        shortfall = self._admission_limit() - self.manager.n_groups_held
        if shortfall > 0:
            step = self._steps_done + self._open_steps + 1
            self.manager.enqueue(self._next_samples(shortfall), step)

    def _gate_complete(self, trained_version: int) -> tuple[int, int]:
        """Drop or requeue the over-age complete groups; return (dropped, requeued)."""
        _, stale = self.gate.split(self.manager.complete_groups(), trained_version)
        for group in stale:
            logger.warning(
                "group %s is %s versions behind the trained weights (v%d), over max_staleness=%s: %s",
                group.data_id,
                group_age(group, trained_version),
                trained_version,
                self.gate.max_staleness,
                "requeued" if self.gate.strategy == "requeue" else "dropped",
            )
            if self.gate.strategy == "requeue":
                self.manager.requeue(group, self._steps_done + self._open_steps + 1)
            else:
                self.manager.release([group])
        n = len(stale)
        return (0, n) if self.gate.strategy == "requeue" else (n, 0)

    def _take_metrics(
        self, groups: list[CarriedGroup], trained_version: int, waited: float
    ) -> dict[str, float]:
        ages = [age for group in groups if (age := group_age(group, trained_version)) is not None]
        completed = [rollout for group in groups for rollout in group.completed]
        counts, self._counts = self._counts, WaitCounts()
        hook_errors = self.manager.hooks.n_errors - self._n_hook_errors
        self._n_hook_errors = self.manager.hooks.n_errors
        recreated, self._n_recreated = self._n_recreated, 0
        metrics = {
            **counts.metrics(),
            **lifecycle_metrics(completed),
            "training/n_hook_errors": float(hook_errors),
            "training/async/wait_seconds": waited,
            "training/async/groups_held": float(self.manager.n_groups_held),
            "training/async/n_pending_rollouts": float(self.manager.n_pending_rollouts),
            "training/async/n_trained_groups_without_weight_version": float(len(groups) - len(ages)),
            "training/async/n_lost_rollouts_recreated": float(recreated),
        }
        if ages:
            metrics["training/async/staleness_mean"] = sum(ages) / len(ages)
            metrics["training/async/staleness_max"] = float(max(ages))
        return metrics


__all__ = ("CollectedGroups", "CollectorError", "GroupCollector")
