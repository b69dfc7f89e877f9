"""Sync mode: enqueue a whole batch and wait until every rollout of it is terminal."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from agl_rollout._tracker import RolloutTracker, WaitCounts
from agl_rollout.batch import Batch
from agl_rollout.client import AglClient
from agl_rollout.config import RolloutManagerConfig
from agl_rollout.hooks import HookRunner, RolloutHooks
from agl_rollout.lifecycle import lifecycle_metrics
from agl_rollout.pacing import SweepPacer
from agl_rollout.progress import WaitProgress
from agl_rollout.queueing import build_requests, enqueue
from agl_rollout.recovery import RecoveryBudget, recover_lost
from agl_types import CompletedRollout, EnqueuedRollout, ModelRegistration


@dataclass(frozen=True)
class RolloutBatchResult:
    """The completed rollouts of one wait, in detection order, and the wait's metrics."""

    completed: list[CompletedRollout]
    metrics: dict[str, float] = field(default_factory=dict[str, float])


class SyncRolloutManager:
    """Queues rollouts for a batch and waits for all of them (sync training and all validation).

    Every finished rollout is hooked, turned into a CompletedRollout and deleted from the
    server as soon as it is seen, so server state stays bounded by what is in flight. A
    rollout that never ends is failed by the trainer after ``rollout_timeout_seconds``. Sweeps
    come every ``poll_interval_seconds``, further apart while the wave is young and far from done
    (:class:`~agl_rollout.pacing.SweepPacer`). A wait that raises (Ctrl-C, an error) leaves its
    rollouts to :meth:`cancel_pending`. ``hooks``: the user's hooks, or a :class:`HookRunner`
    shared with another manager (the calls of the two then never overlap).
    """

    def __init__(
        self,
        client: AglClient,
        config: RolloutManagerConfig,
        *,
        hooks: RolloutHooks | HookRunner | None = None,
    ) -> None:
        self.client = client
        self.config = config
        self.hooks = hooks if isinstance(hooks, HookRunner) else HookRunner(hooks, client)
        self._unfinished: tuple[RolloutTracker, dict[str, EnqueuedRollout]] | None = None
        """The tracker and pending rollouts of a wait that raised (or is running)."""

    def enqueue_and_wait_until_completed(
        self,
        batch: Batch,
        *,
        is_train: bool,
        step: int = 0,
        models: Sequence[ModelRegistration] | None = None,
    ) -> RolloutBatchResult:
        """Enqueue ``train_rollout_n`` rollouts per sample (1 for validation) and wait for all.

        ``models``, when given, replace the gateway's registered endpoints first (their
        ``version`` should be ``step``, the weight version that serves this batch).
        """
        n_hook_errors_before = self.hooks.n_errors
        if models is not None:
            self.client.register_models(models)
        per_sample = self.config.train_rollout_n if is_train else 1
        queued = build_requests(
            batch,
            is_train=is_train,
            rollouts_per_sample=per_sample,
            step=step,
            rollout_config=self.config.rollout_config(),
            hooks=self.hooks,
        )
        if not queued.requests:
            return RolloutBatchResult(completed=[])
        tracker = RolloutTracker(self.client, self.config, self.hooks)
        tracker.sync_cursor()
        pending = {record.rollout_id: record for record in queued.enqueued}
        self._unfinished = (tracker, pending)
        enqueue(self.client, queued)
        completed, counts = self._wait(tracker, pending, is_train=is_train)
        self._unfinished = None
        metrics = {
            **counts.metrics(),
            "training/n_hook_errors": float(self.hooks.n_errors - n_hook_errors_before),
            **lifecycle_metrics(completed),
        }
        return RolloutBatchResult(completed=completed, metrics=metrics)

    def cancel_pending(self, reason: str) -> int:
        """Fail and delete on the server every rollout of a wait that raised, so no agent runs or
        queues them on. Returns how many were cancelled: a server that cannot be reached ends the
        clean-up with one warning."""
        if self._unfinished is None:
            return 0
        tracker, pending = self._unfinished
        self._unfinished = None
        return tracker.cancel_all(list(pending.values()), reason)

    def _wait(
        self, tracker: RolloutTracker, pending: dict[str, EnqueuedRollout], *, is_train: bool
    ) -> tuple[list[CompletedRollout], WaitCounts]:
        counts = WaitCounts()
        completed: list[CompletedRollout] = []
        label = "train rollouts" if is_train else "val rollouts"
        progress = WaitProgress(label, len(pending), enabled=self.config.progress)
        recoveries = RecoveryBudget(self.client.base_url)
        pacer = SweepPacer(self.config.poll_interval_seconds, self.config.poll_interval_cap)
        while pending:
            completed.extend(tracker.sweep(pending, counts))
            if tracker.loss_suspected:
                tracker.loss_suspected = False
                replaced = recover_lost(
                    self.client, self.config, tracker, recoveries, list(pending.values()), is_train=is_train
                )
                for old, new in replaced:
                    del pending[old.rollout_id]
                    pending[new.rollout_id] = new
                counts.n_recreated += len(replaced)
            progress.update(counts.n_done, counts, pending)
            if pending:
                time.sleep(pacer.pause(counts.n_done, len(pending)))
        progress.close(counts.n_done, counts)
        return completed, counts


__all__ = ("RolloutBatchResult", "SyncRolloutManager")
