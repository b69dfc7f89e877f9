"""Re-create the rollouts a restarted agl-server lost, so a wait goes on instead of failing.

agl-server keeps its store in memory: a restart loses every queued and running rollout and the
gateway's model registrations. A completion log shorter than the tracker's cursor says the server
restarted (every pending rollout is then lost and the cursor restarts at the new log's end);
otherwise each pending rollout is looked up once. Each lost rollout is created again under a new
rollout id (an agent of the old one may still be running and must not write into the new one),
with its group's ``data_id``, its recorded input (``on_enqueue`` already rewrote it and does not
run again) and a fresh enqueue time, so the new one gets the whole timeout. The last model
registration is restored first, so the new rollouts' agents find the model.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence

from agl_rollout._tracker import RolloutTracker
from agl_rollout.client import AglClient
from agl_rollout.config import RolloutManagerConfig
from agl_rollout.errors import AglHTTPError, RolloutsLostError
from agl_rollout.queueing import QueuedBatch, enqueue, rollout_request
from agl_types import EnqueuedRollout

logger = logging.getLogger("agl_rollout.recovery")

MAX_RECOVERIES_PER_WAIT = 3
"""More lost rollouts than this many times in one wait means something deletes them on purpose."""


class RecoveryBudget:
    """Counts the recoveries of one wait; past :data:`MAX_RECOVERIES_PER_WAIT` it raises."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.spent = 0

    def spend(self, lost: Sequence[EnqueuedRollout]) -> None:
        """Account for one recovery of ``lost`` (none lost costs nothing)."""
        if not lost:
            return
        self.spent += 1
        if self.spent > MAX_RECOVERIES_PER_WAIT:
            raise RolloutsLostError(
                self.base_url,
                [record.rollout_id for record in lost],
                f"lost again after {MAX_RECOVERIES_PER_WAIT} re-creations in one wait",
            )


def _find_lost(
    client: AglClient, tracker: RolloutTracker, records: Sequence[EnqueuedRollout]
) -> list[EnqueuedRollout]:
    """The ``records`` the server no longer has; resets ``tracker``'s cursor after a restart."""
    total_terminal = client.terminal_page(0, limit=1).total_terminal
    if tracker.cursor is not None and total_terminal < tracker.cursor:
        tracker.cursor = total_terminal
        return list(records)
    return [record for record in records if not _exists(client, record.rollout_id)]


def _recreate(
    client: AglClient, config: RolloutManagerConfig, lost: Sequence[EnqueuedRollout], *, is_train: bool
) -> list[EnqueuedRollout]:
    """Create each of ``lost`` again under a new id; returns the new records, in the same order."""
    if not lost:
        return []
    client.restore_models()
    rollout_config = config.rollout_config()
    fresh = [
        old.model_copy(update={"rollout_id": uuid.uuid4().hex, "running_at": None, "finished_at": None})
        for old in lost
    ]
    requests = [
        rollout_request(
            record.input, is_train=is_train, rollout_config=rollout_config, rollout_id=record.rollout_id
        )
        for record in fresh
    ]
    logger.warning("re-creating %d rollout(s) that agl-server at %s lost", len(fresh), client.base_url)
    enqueue(client, QueuedBatch(requests=requests, enqueued=fresh))  # stamps fresh enqueue times
    return fresh


def recover_lost(
    client: AglClient,
    config: RolloutManagerConfig,
    tracker: RolloutTracker,
    budget: RecoveryBudget,
    records: Sequence[EnqueuedRollout],
    *,
    is_train: bool,
) -> list[tuple[EnqueuedRollout, EnqueuedRollout]]:
    """:func:`_find_lost` among ``records``, charged to ``budget``, then :func:`_recreate`: each lost
    record paired with the record that replaces it."""
    lost = _find_lost(client, tracker, records)
    budget.spend(lost)
    return list(zip(lost, _recreate(client, config, lost, is_train=is_train), strict=True))


def _exists(client: AglClient, rollout_id: str) -> bool:
    try:
        client.get_rollout(rollout_id)
    except AglHTTPError as exc:
        if exc.status_code == 404:
            return False
        raise
    return True


__all__ = ("MAX_RECOVERIES_PER_WAIT", "RecoveryBudget", "recover_lost")
