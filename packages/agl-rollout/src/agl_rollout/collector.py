"""The one producer of training groups: a thread that keeps GRPO groups running on agl-server.

Sync, carry-over async and fully async are three settings of one :class:`GroupCollector`
(see :class:`~agl_rollout.staleness.Admission`). Its thread owns an
:class:`AsyncRolloutManager`: it admits new samples as the admission rule allows, sweeps the
server every poll interval, and moves each group that completes to a ready list. The trainer
calls :meth:`GroupCollector.take` for a step's groups (blocking only while fewer than
``train_batch_size`` are ready) and :meth:`GroupCollector.step_done` once the step is over.

The lock guards the ready list and the counters only: the thread reads the dataset, calls the
server and runs the hooks without it, so a slow hook or a slow server never blocks :meth:`take`.

The bound on admission is not an age guarantee (a slow group can outlive it), so :meth:`take`
passes every complete group through the :class:`StalenessGate`, drops groups whose calls were
served by weights newer than the ones being trained (a dead run's, after a resume) and runs their
samples again, and applies
the caller's ``keep`` filter (dynamic sampling); a filtered or dropped group frees its place, so
the thread admits another sample while the take waits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

from agl_rollout._tracker import WaitCounts
from agl_rollout.async_manager import AsyncRolloutManager, AsyncRolloutState, CarriedGroup
from agl_rollout.batch import Batch
from agl_rollout.errors import AglUnavailableError
from agl_rollout.lifecycle import lifecycle_metrics
from agl_rollout.pacing import SweepPacer
from agl_rollout.progress import WaitProgress
from agl_rollout.staleness import Admission, StalenessGate, group_age, is_ahead
from agl_types import CompletedRollout, EnqueuedRollout

logger = logging.getLogger("agl_rollout.collector")

CANCEL_REASON = "cancelled: the trainer stopped"


class CollectorError(RuntimeError):
    """The collector's thread failed; raised by :meth:`GroupCollector.take` with the cause chained."""


@dataclass(frozen=True)
class CollectedGroups:
    """One step's groups (members adjacent, oldest group first) and the collection's metrics.

    ``n_examined`` counts the fresh complete groups the take looked at, ``n_filtered`` those the
    ``keep`` filter turned away; ``short`` says the take stopped at ``max_examined`` with fewer
    than ``train_batch_size`` groups kept.
    """

    groups: list[CarriedGroup]
    metrics: dict[str, float] = field(default_factory=dict[str, float])
    n_examined: int = 0
    n_filtered: int = 0
    short: bool = False

    @property
    def rollouts(self) -> list[CompletedRollout]:
        return [rollout for group in self.groups for rollout in group.completed]


def _add_counts(total: WaitCounts, more: WaitCounts) -> None:
    for counter in fields(WaitCounts):
        setattr(total, counter.name, getattr(total, counter.name) + getattr(more, counter.name))


def _by_age(group: CarriedGroup) -> tuple[int, int]:
    return group.first_step, group.completed_seq or 0


class GroupCollector:
    """Streams complete groups from agl-server in a background thread; see the module docstring.

    ``next_samples(k)`` returns the next ``k`` samples of the training data (called from the
    collector's thread only). ``admission`` defaults to the fully-async rule with the gate's
    bound, ``manager.train_batch_size`` groups per step and ``manager.async_train_batch_size``
    groups at most. ``steps_done`` is the number of steps already trained (a resumed run's global
    step), so new groups are labelled with the step that will train them.
    """

    def __init__(
        self,
        manager: AsyncRolloutManager,
        next_samples: Callable[[int], Batch],
        gate: StalenessGate,
        *,
        admission: Admission | None = None,
        steps_done: int = 0,
    ) -> None:
        self.manager = manager
        self.gate = gate
        self.train_batch_size = manager.train_batch_size
        self.admission = admission or Admission(
            manager.train_batch_size, manager.async_train_batch_size, gate.max_staleness, overlap=True
        )
        self._next_samples = next_samples
        self._steps_done = steps_done
        self._step_open = False
        self._taken = False
        self._ready: list[CarriedGroup] = []
        self._n_taking = 0
        """Groups a waiting take has kept so far: still held, so they count against admission."""
        self._to_requeue: list[tuple[CarriedGroup, int]] = []
        self._pending: dict[str, EnqueuedRollout] = {}
        self._running_first_steps = [group.first_step for group in manager.groups()]
        """The first step of each group the manager holds (running, or complete since the last sweep)."""
        self._running_rollouts = sum(group.n_rollouts for group in manager.groups())
        self._n_carried_rollouts = 0
        self._counts = WaitCounts()
        self._hook_errors_seen = self._hook_errors = manager.hooks.n_errors
        self._n_recreated = 0
        self._admission_holds = 0
        self._admitting = False
        self._state_wanted = False
        self._state_copy: AsyncRolloutState | None = None
        self.n_polls = 0
        """Sweeps the thread has finished (the trainer's clock of collection progress)."""
        self._error: BaseException | None = None
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agl-collector", daemon=True)

    def start(self) -> GroupCollector:
        self._thread.start()
        return self

    def stop(self, *, cancel: bool = False) -> int:
        """Stop admitting and polling. Held groups stay in :attr:`state`; with ``cancel`` their
        pending rollouts are failed and deleted on the server, so no agent runs them on. Returns
        how many were cancelled."""
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        if self._thread.is_alive():
            self._thread.join()
        return self.manager.cancel_pending(CANCEL_REASON) if cancel else 0

    def __enter__(self) -> GroupCollector:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def state(self) -> AsyncRolloutState:
        """A consistent copy of every group held, for checkpoints (taken between the thread's sweeps)."""
        with self._lock:
            if not self._thread.is_alive():
                return self._copy_state()
            self._state_wanted, self._state_copy = True, None
            self._lock.notify_all()
            while self._state_copy is None:
                self._raise_error()
                if not self._thread.is_alive():  # stopped meanwhile: nothing changes the groups now
                    return self._copy_state()
                self._lock.wait(1.0)
            return self._state_copy

    @contextmanager
    def admission_held(self) -> Generator[None]:
        """Admit no new sample inside the block (a checkpoint saves the dataloader and :attr:`state`
        in it, which must agree on which samples were drawn)."""
        with self._lock:
            self._admission_holds += 1
            while self._admitting:
                self._lock.wait()
        try:
            yield
        finally:
            with self._lock:
                self._admission_holds -= 1
                self._lock.notify_all()

    @property
    def n_complete(self) -> int:
        """Complete groups ready to be taken."""
        with self._lock:
            return len(self._ready)

    def take(
        self,
        trained_version: int,
        *,
        timeout_s: float,
        keep: Callable[[CarriedGroup], bool] | None = None,
        max_examined: int | None = None,
        rerun: Callable[[CarriedGroup], bool] | None = None,
    ) -> CollectedGroups:
        """Block until ``train_batch_size`` fresh complete groups pass ``keep``, and hand them over.

        ``trained_version`` is the weight version the step trains (ages are measured against it).
        Over-age groups are dropped or requeued as the gate says, groups from newer weights are
        dropped and their samples run again (fresh groups), so are the groups ``rerun`` names (the
        caller's: a server died under them; ``training/n_rollouts_rerun`` counts their rollouts), and groups ``keep`` refuses are let go (the thread admits others meanwhile); after
        ``max_examined`` groups the take returns what it kept. Raises :class:`CollectorError` when
        the thread failed and ``TimeoutError`` after ``timeout_s`` without enough groups.
        """
        started = time.monotonic()
        kept: list[CarriedGroup] = []
        dropped = requeued = ahead = examined = filtered = rerun_rollouts = 0
        progress = WaitProgress("train groups", self.train_batch_size, enabled=self.manager.config.progress)
        with self._lock:
            while True:
                self._raise_error()
                for group in sorted(self._ready, key=_by_age):
                    if len(kept) == self.train_batch_size or examined == max_examined:
                        break
                    self._ready.remove(group)
                    if rerun is not None and rerun(group):
                        self._to_requeue.append((group, self._steps_done + 1))
                        rerun_rollouts += group.n_rollouts
                        logger.warning(
                            "group %s had rollouts fail on a server that died: its sample runs again",
                            group.data_id,
                        )
                    elif is_ahead(group, trained_version):
                        # Weights this run never had served it: its sample runs again, as a fresh group.
                        self._to_requeue.append((group, self._steps_done + 1))
                        ahead += 1
                        self._warn_ahead(group, trained_version)
                    elif self.gate.is_stale(group, trained_version):
                        self._warn_stale(group, trained_version)
                        if self.gate.strategy == "requeue":
                            self._to_requeue.append((group, self._steps_done + 1))
                            requeued += 1
                        else:
                            dropped += 1
                    else:
                        examined += 1
                        if keep is None or keep(group):
                            kept.append(group)
                        else:
                            filtered += 1
                self._n_taking = len(kept)
                self._lock.notify_all()
                limit_hit = max_examined is not None and examined >= max_examined
                if len(kept) == self.train_batch_size or limit_hit:
                    break
                progress.update(len(kept), self._counts, self._pending)
                waited = time.monotonic() - started
                if waited >= timeout_s:
                    self._ready.extend(kept)
                    self._n_taking = 0
                    raise TimeoutError(
                        f"the collector holds {len(kept)} of train_batch_size={self.train_batch_size} complete "
                        f"groups after {waited:.0f} s ({len(self._pending)} rollouts pending); "
                        "check the agents, or raise the take timeout"
                    )
                self._lock.wait(min(timeout_s - waited, 1.0))
            progress.close(len(kept), self._counts)
            self._n_taking = 0
            self._step_open = self._taken = True
            metrics = self._take_metrics(kept, trained_version, time.monotonic() - started)
            self._lock.notify_all()
        metrics["training/async/dropped_stale"] = float(dropped)
        metrics["training/async/requeued_stale"] = float(requeued)
        metrics["training/async/dropped_future_version"] = float(ahead)
        metrics["training/n_rollouts_rerun"] = float(rerun_rollouts)
        short = len(kept) < self.train_batch_size
        return CollectedGroups(kept, metrics, n_examined=examined, n_filtered=filtered, short=short)

    def step_done(self) -> None:
        """The taken step is over (its weights published): admit the groups the next step may start."""
        with self._lock:
            self._step_open = False
            self._steps_done += 1
            self._lock.notify_all()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise CollectorError(f"the rollout collector failed: {self._error!r}") from self._error

    def _run(self) -> None:
        try:
            recreated = self.manager.recreate_lost_after_resume()
            with self._lock:
                self._n_recreated += recreated
            pacer = SweepPacer(
                self.manager.config.poll_interval_seconds, self.manager.config.poll_interval_cap
            )
            n_done = 0
            while not self._stop.is_set():
                with self._lock:
                    to_requeue, self._to_requeue = self._to_requeue, []
                    new_step, self._taken = self._taken, False
                if new_step:
                    self.manager.new_wait()
                    pacer, n_done = (
                        SweepPacer(pacer.poll_interval_seconds, pacer.max_poll_interval_seconds),
                        0,
                    )
                for group, step in to_requeue:
                    self.manager.requeue(group, step)
                self._top_up()
                counts = WaitCounts()
                self.manager.poll(counts)
                complete = self.manager.pop_complete()
                n_done += counts.n_done
                with self._lock:
                    self._ready.extend(complete)
                    _add_counts(self._counts, counts)
                    self._pending = self.manager.pending_rollouts()
                    running = self.manager.groups()
                    self._running_first_steps = [group.first_step for group in running]
                    self._running_rollouts = sum(group.n_rollouts for group in running)
                    self._hook_errors = self.manager.hooks.n_errors
                    self.n_polls += 1
                    if self._state_wanted:
                        self._state_wanted, self._state_copy = False, self._copy_state()
                    self._lock.notify_all()
                self._stop.wait(pacer.pause(n_done, len(self._pending)))
        except BaseException as exc:  # handed to the trainer by take(), never swallowed
            if isinstance(exc, AglUnavailableError):  # the server is gone, which its message says: no bug
                logger.error("rollout collector stopped: %s", exc)
            else:
                logger.exception("rollout collector stopped on an error")
            with self._lock:
                self._error = exc
                self._lock.notify_all()

    def _top_up(self) -> None:
        """Admit as many new samples as the admission rule allows (the dataset and the server are
        called outside the lock)."""
        with self._lock:
            if self._admission_holds:
                return
            held = self.manager.n_groups_held + len(self._ready) + len(self._to_requeue) + self._n_taking
            shortfall = self.admission.limit(self._step_open) - held
            if shortfall <= 0:
                return
            step = self._steps_done + int(self._step_open) + 1
            self._admitting = True
        try:
            self.manager.enqueue(self._next_samples(shortfall), step)
        finally:
            with self._lock:
                self._admitting = False
                self._lock.notify_all()

    def _copy_state(self) -> AsyncRolloutState:
        """The manager's state with the ready and to-be-requeued groups (call with the lock held)."""
        state = self.manager.state
        extra = [*self._ready, *(group for group, _ in self._to_requeue)]
        state.groups += [group.model_copy(deep=True) for group in extra]
        return state

    def _warn_stale(self, group: CarriedGroup, trained_version: int) -> None:
        logger.warning(
            "group %s is %s versions behind the trained weights (v%d), over max_staleness=%s: %s",
            group.data_id,
            group_age(group, trained_version),
            trained_version,
            self.gate.max_staleness,
            "requeued" if self.gate.strategy == "requeue" else "dropped",
        )

    def _warn_ahead(self, group: CarriedGroup, trained_version: int) -> None:
        span = group.version_span()
        logger.warning(
            "group %s has model calls served by weight version %s, newer than the trained v%d "
            "(weights of an earlier run that died after publishing them): dropped, its sample runs again",
            group.data_id,
            span[1] if span else None,
            trained_version,
        )

    def _take_metrics(
        self, groups: list[CarriedGroup], trained_version: int, waited: float
    ) -> dict[str, float]:
        """The take's metrics, and the counters since the last take reset (call with the lock held)."""
        ages = [age for group in groups if (age := group_age(group, trained_version)) is not None]
        completed = [rollout for group in groups for rollout in group.completed]
        counts, self._counts = self._counts, WaitCounts()
        hook_errors, self._hook_errors_seen = self._hook_errors - self._hook_errors_seen, self._hook_errors
        recreated, self._n_recreated = self._n_recreated, 0
        metrics = {
            **counts.metrics(),
            **lifecycle_metrics(completed),
            "training/n_hook_errors": float(hook_errors),
            "training/async/wait_seconds": waited,
            "training/async/groups_held": float(len(self._running_first_steps) + len(self._ready)),
            "training/async/n_pending_rollouts": float(len(self._pending)),
            "training/async/n_trained_groups_without_weight_version": float(len(groups) - len(ages)),
            "training/async/n_lost_rollouts_recreated": float(recreated),
        }
        if ages:
            metrics["training/async/staleness_mean"] = sum(ages) / len(ages)
            metrics["training/async/staleness_max"] = float(max(ages))
        return metrics | self._carry_over_metrics(groups)

    def _carry_over_metrics(self, groups: list[CarriedGroup]) -> dict[str, float]:
        """What the step trained and what it carries into the next, in steps (the group's first
        step against the one training it) and rollouts (call with the lock held)."""
        step = self._steps_done + 1
        carried = self._running_rollouts + sum(group.n_rollouts for group in self._ready)
        first_steps = [*self._running_first_steps, *(group.first_step for group in self._ready)]
        metrics = {
            "training/async/n_prev_carry_over_rollouts": float(self._n_carried_rollouts),
            "training/async/n_completed_rollouts": float(sum(group.n_rollouts for group in groups)),
            "training/async/n_new_carry_over_rollouts": float(carried),
            "training/async/new_carry_over_age_max_steps": float(
                max((step - f for f in first_steps), default=0)
            ),
        }
        self._n_carried_rollouts = carried
        if groups:
            lags = [step - group.first_step for group in groups]
            metrics["training/async/trained_group_staleness/mean"] = sum(lags) / len(lags)
            metrics["training/async/trained_group_staleness/max"] = float(max(lags))
        return metrics


__all__ = ("CANCEL_REASON", "CollectedGroups", "CollectorError", "GroupCollector")
