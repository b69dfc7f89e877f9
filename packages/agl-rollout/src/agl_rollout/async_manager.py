"""The groups the collector holds: ``async_train_batch_size`` GRPO groups at most, by ``data_id``.

A group (one ``data_id``) is complete when all ``train_rollout_n`` of its rollouts are terminal.
:class:`AsyncRolloutManager` is driven by :class:`~agl_rollout.collector.GroupCollector`'s thread,
the one producer of training groups (its admission rule says how many samples to enqueue): it
enqueues groups, sweeps the server, and hands complete groups over; unfinished ones carry over whole.
Members that finished are finished once (hooked, turned into a CompletedRollout and deleted on the
server when first seen) and never polled or hooked again. The carried state is a pydantic model,
so a trainer can checkpoint it and resume, also against a restarted server: pending members it
lost are created again (``training/async/n_lost_rollouts_recreated``); so are those a server
restart loses during a wait (``training/n_rollouts_recreated``, :mod:`agl_rollout.recovery`).
"""

from __future__ import annotations

import time
import uuid

from pydantic import BaseModel, Field

from agl_rollout._tracker import RolloutTracker, WaitCounts
from agl_rollout.batch import Batch
from agl_rollout.client import AglClient
from agl_rollout.config import RolloutManagerConfig
from agl_rollout.hooks import HookRunner, RolloutHooks
from agl_rollout.queueing import QueuedBatch, build_requests, enqueue, rollout_request
from agl_rollout.recovery import RecoveryBudget, recover_lost
from agl_types import CompletedRollout, EnqueuedRollout


class CarriedGroup(BaseModel):
    """One GRPO group held by the async manager: its pending (by rollout id) and finished members.

    ``first_step`` is the step that enqueued it; ``completed_seq`` orders complete groups
    by when their last member finished (``None`` while some member is pending).
    """

    data_id: str
    first_step: int
    pending: dict[str, EnqueuedRollout] = Field(default_factory=dict[str, EnqueuedRollout])
    completed: list[CompletedRollout] = Field(default_factory=list[CompletedRollout])
    completed_seq: int | None = None

    @property
    def is_complete(self) -> bool:
        return not self.pending

    @property
    def n_rollouts(self) -> int:
        return len(self.pending) + len(self.completed)

    def version_span(self) -> tuple[int, int] | None:
        """(oldest, newest) weight version of the finished members' model calls; ``None`` when none carries one."""
        known = [t.weight_version for r in self.completed for t in r.triplets if t.weight_version is not None]
        return (min(known), max(known)) if known else None


class AsyncRolloutState(BaseModel):
    """Everything the async manager carries between steps (checkpoint with ``model_dump``)."""

    cursor: int | None = None
    next_completed_seq: int = 0
    groups: list[CarriedGroup] = Field(default_factory=list[CarriedGroup])


class AsyncRolloutManager:
    """Waits by group: see the module docstring. Construct once per training run. ``hooks``: the
    user's hooks, or a :class:`HookRunner` shared with another manager (their calls never overlap)."""

    def __init__(
        self,
        client: AglClient,
        config: RolloutManagerConfig,
        *,
        train_batch_size: int,
        async_train_batch_size: int | None,
        hooks: RolloutHooks | HookRunner | None = None,
        state: AsyncRolloutState | None = None,
    ) -> None:
        if train_batch_size < 1:
            raise ValueError(f"train_batch_size must be >= 1, got {train_batch_size}")
        if async_train_batch_size is None or async_train_batch_size < train_batch_size:
            raise ValueError(
                f"async_train_batch_size ({async_train_batch_size}) must be >= train_batch_size "
                f"({train_batch_size}): a step trains on train_batch_size groups held at once"
            )
        self.client = client
        self.config = config
        self.train_batch_size = train_batch_size
        self.async_train_batch_size = async_train_batch_size
        self.hooks = hooks if isinstance(hooks, HookRunner) else HookRunner(hooks, client)
        restored = state.model_copy(deep=True) if state is not None else AsyncRolloutState()
        self._groups = {group.data_id: group for group in restored.groups}
        self._next_seq = restored.next_completed_seq
        self._tracker = RolloutTracker(client, config, self.hooks)
        self._tracker.cursor = restored.cursor
        self._check_resumed = any(group.pending for group in self._groups.values())
        self._recoveries = RecoveryBudget(client.base_url)

    @property
    def state(self) -> AsyncRolloutState:
        """A copy of the carried state, for checkpoints."""
        return AsyncRolloutState(
            cursor=self._tracker.cursor,
            next_completed_seq=self._next_seq,
            groups=[group.model_copy(deep=True) for group in self._groups.values()],
        )

    @property
    def n_groups_held(self) -> int:
        return len(self._groups)

    def enqueue(self, batch: Batch, step: int) -> None:
        """Create ``train_rollout_n`` rollouts per sample of ``batch``, each sample a new group first seen at ``step``."""
        queued = build_requests(
            batch,
            is_train=True,
            rollouts_per_sample=self.config.train_rollout_n,
            step=step,
            rollout_config=self.config.rollout_config(),
            hooks=self.hooks,
        )
        if not queued.requests:
            return
        self._tracker.sync_cursor()
        enqueue(self.client, queued)
        for record in queued.enqueued:
            group = self._groups.setdefault(
                record.data_id, CarriedGroup(data_id=record.data_id, first_step=step)
            )
            group.pending[record.rollout_id] = record

    def recreate_lost_after_resume(self) -> int:
        """Re-create the pending members of a resumed state that the server no longer has (once per resume).

        See :mod:`agl_rollout.recovery`: finished members are kept, lost pending ones are created
        again under new ids in their groups. Returns how many were re-created.
        """
        if not self._check_resumed:
            return 0
        self._check_resumed = False
        return self._recreate_lost([r for group in self._groups.values() for r in group.pending.values()])

    def _recreate_lost(self, members: list[EnqueuedRollout]) -> int:
        replaced = recover_lost(
            self.client, self.config, self._tracker, self._recoveries, members, is_train=True
        )
        group_of = {rid: group for group in self._groups.values() for rid in group.pending}
        for old, new in replaced:
            group = group_of[old.rollout_id]
            del group.pending[old.rollout_id]
            group.pending[new.rollout_id] = new
        return len(replaced)

    def poll(self, counts: WaitCounts) -> int:
        """One sweep: finish the pending members that turned terminal; return how many groups completed."""
        pending = {rid: r for g in self._groups.values() for rid, r in g.pending.items()}
        group_of = {rid: g for g in self._groups.values() for rid in g.pending}
        newly_complete = 0
        for rollout in self._tracker.sweep(pending, counts):
            group = group_of.pop(rollout.rollout_id)
            del group.pending[rollout.rollout_id]
            group.completed.append(rollout)
            if group.is_complete:
                group.completed_seq = self._next_seq
                self._next_seq += 1
                newly_complete += 1
        if self._tracker.loss_suspected:
            self._tracker.loss_suspected = False
            counts.n_recreated += self._recreate_lost(list(pending.values()))
        return newly_complete

    def groups(self) -> list[CarriedGroup]:
        """The groups held (the manager's own objects: read them on the thread that drives it)."""
        return list(self._groups.values())

    def pending_rollouts(self) -> dict[str, EnqueuedRollout]:
        """Every pending member of the held groups, by rollout id (a new dict)."""
        return {rid: record for group in self._groups.values() for rid, record in group.pending.items()}

    @property
    def n_pending_rollouts(self) -> int:
        return sum(len(group.pending) for group in self._groups.values())

    def complete_groups(self) -> list[CarriedGroup]:
        """The complete groups held, oldest first (the step that enqueued them, then completion order)."""
        complete = [group for group in self._groups.values() if group.is_complete]
        complete.sort(key=lambda group: (group.first_step, group.completed_seq or 0))
        return complete

    def new_wait(self) -> None:
        """Start the budget of lost-rollout recoveries over (once per step)."""
        self._recoveries = RecoveryBudget(self.client.base_url)

    def pop_complete(self) -> list[CarriedGroup]:
        """Stop holding the complete groups and return them, oldest first (see :meth:`complete_groups`)."""
        complete = self.complete_groups()
        for group in complete:
            del self._groups[group.data_id]
        return complete

    def cancel_pending(self, reason: str) -> int:
        """Fail and delete every pending member on the server, so no agent runs or queues them on;
        the groups stay held (a checkpoint's copy re-creates them on resume). Returns how many were
        cancelled: a server that cannot be reached ends the clean-up with one warning."""
        return self._tracker.cancel_all(list(self.pending_rollouts().values()), reason)

    def requeue(self, group: CarriedGroup, step: int) -> None:
        """Replace a complete group by a fresh one of the same sample: ``train_rollout_n`` new rollouts
        of its recorded input (``on_enqueue`` already rewrote it and does not run again), enqueued at ``step``.
        """
        template = group.completed[0]
        self._groups.pop(group.data_id, None)
        rollout_config = self.config.rollout_config()
        records = [
            EnqueuedRollout(
                rollout_id=uuid.uuid4().hex,
                data_id=group.data_id,
                step=step,
                sample_idx_in_step=template.sample_idx_in_step,
                enqueue_time=time.time(),
                input=template.input,
            )
            for _ in range(self.config.train_rollout_n)
        ]
        requests = [
            rollout_request(r.input, is_train=True, rollout_config=rollout_config, rollout_id=r.rollout_id)
            for r in records
        ]
        self._tracker.sync_cursor()
        enqueue(self.client, QueuedBatch(requests=requests, enqueued=records))
        fresh = CarriedGroup(data_id=group.data_id, first_step=step)
        fresh.pending.update((r.rollout_id, r) for r in records)
        self._groups[group.data_id] = fresh


__all__ = ("AsyncRolloutManager", "AsyncRolloutState", "CarriedGroup")
