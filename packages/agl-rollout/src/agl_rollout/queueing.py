"""Turn a train or validation batch into rollout create requests, one GRPO group per sample.

Each sample gets a fresh uuid ``data_id`` (its group key) kept on the trainer side, in the
``EnqueuedRollout``; it is *not* written into the rollout input, so agents see exactly the
sample's fields (nothing of the caller's data is changed or added). The managers map the
server's rollout ids back to groups themselves, so they never need the server's
``data_id`` projection.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from agl_rollout.batch import Batch, batch_rows
from agl_rollout.client import AglClient
from agl_rollout.hooks import HookRunner
from agl_types import EnqueuedRollout, RolloutConfig, RolloutCreate, RolloutMetadata


@dataclass(frozen=True)
class QueuedBatch:
    """The requests of one batch and the trainer-side records of the rollouts they create."""

    requests: list[RolloutCreate]
    enqueued: list[EnqueuedRollout]


def rollout_request(
    row: object, *, is_train: bool, rollout_config: RolloutConfig, rollout_id: str | None = None
) -> RolloutCreate:
    """The create request of one rollout of ``row`` (its input)."""
    return RolloutCreate(
        input=row, is_train=is_train, config=rollout_config, metadata=RolloutMetadata(), rollout_id=rollout_id
    )


def build_requests(
    batch: Batch,
    *,
    is_train: bool,
    rollouts_per_sample: int,
    step: int,
    rollout_config: RolloutConfig,
    hooks: HookRunner,
) -> QueuedBatch:
    """One request per rollout: ``rollouts_per_sample`` per sample, all sharing its ``data_id``.

    ``hooks.on_enqueue`` may rewrite each request; the rollout id is chosen after it, so the
    hook cannot collide ids, and before the first create try, so retries are idempotent.
    """
    requests: list[RolloutCreate] = []
    enqueued: list[EnqueuedRollout] = []
    for sample_idx, row in enumerate(batch_rows(batch)):
        data_id = str(uuid.uuid4())
        for _ in range(rollouts_per_sample):
            request = rollout_request(row, is_train=is_train, rollout_config=rollout_config)
            request = hooks.on_enqueue(request).model_copy(update={"rollout_id": uuid.uuid4().hex})
            requests.append(request)
            enqueued.append(
                EnqueuedRollout(
                    rollout_id=request.rollout_id or "",
                    data_id=data_id,
                    step=step,
                    sample_idx_in_step=sample_idx,
                    enqueue_time=time.time(),
                    input=request.input,
                )
            )
    return QueuedBatch(requests=requests, enqueued=enqueued)


def enqueue(client: AglClient, queued: QueuedBatch) -> None:
    """Create every rollout of ``queued`` in one (retried, idempotent) call.

    Enqueue times are stamped just before the call: an agent may pick a rollout up before
    the answer arrives, and a queue wait must not come out negative.
    """
    now = time.time()
    for record in queued.enqueued:
        record.enqueue_time = now
    client.create_rollouts(queued.requests)


__all__ = ("QueuedBatch", "build_requests", "enqueue", "rollout_request")
