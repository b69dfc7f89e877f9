"""Cancel the rollouts a dead trainer left on agl-server, when a new one resumes its checkpoint.

A killed trainer's rollouts stay: those it created after its last checkpoint are queued or
running, and agents would run them for nothing, ahead of the resumed run's work. Each trainer
tags the rollouts it creates with its own run id (:class:`~agl_rollout.client.AglClient`'s
``run_id``), and its checkpoint records that id; the resumed run cancels every rollout of that id
that the checkpoint does not hold (its held groups' pending rollouts carry on), finished ones
too: nothing will read them.
"""

from __future__ import annotations

from collections.abc import Collection

from agl_rollout.client import AglClient
from agl_types import RolloutState

LIST_LIMIT = 100_000
"""How many rollouts one listing returns at most: far more than a run keeps in flight."""


def cancel_orphans(client: AglClient, run_id: str, keep: Collection[str]) -> int:
    """Delete every rollout on the server that run ``run_id`` created, but those in ``keep``; returns
    how many. A queued one is never started; an agent running one gets 404s from then on, as it
    does for any rollout the trainer cancels."""
    orphans = [
        rollout.rollout_id
        for rollout in client.list_rollouts(list(RolloutState), limit=LIST_LIMIT)
        if rollout.metadata.run_id == run_id and rollout.rollout_id not in keep
    ]
    for rollout_id in orphans:
        client.delete_rollout(rollout_id)
    return len(orphans)


__all__ = ("LIST_LIMIT", "cancel_orphans")
