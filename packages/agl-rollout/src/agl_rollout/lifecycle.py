"""Lifecycle timestamps of a rollout and the per-step percentiles of its queue and run times.

``enqueue_time`` is the trainer's clock; ``running_at``/``finished_at`` are the server's
``status.updated_at``: pods start late and in batches, so the time of the RUNNING flip is a
better start time than the enqueue time. Both machines' clocks are mixed, as in the reference.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from agl_types import CompletedRollout, EnqueuedRollout, Rollout, RolloutState, is_terminal


def record_lifecycle(enqueued: EnqueuedRollout, rollout: Rollout) -> None:
    """Update ``enqueued`` in place from one observation of the server's copy.

    ``running_at`` is the ``updated_at`` when RUNNING is first seen, or the terminal
    ``updated_at`` when the rollout was never seen running; ``finished_at`` is set once
    the rollout is terminal.
    """
    status = rollout.status
    if enqueued.running_at is None and status.state is not RolloutState.QUEUING:
        enqueued.running_at = status.updated_at
    if is_terminal(status.state) and enqueued.finished_at is None:
        enqueued.finished_at = status.updated_at


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ascending ``sorted_values``, linearly interpolated
    between closest ranks (numpy's default method).
    """
    if not sorted_values:
        raise ValueError("percentile of an empty sequence")
    rank = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (rank - lo)


def summary(prefix: str, values: Iterable[float]) -> dict[str, float]:
    """``<prefix>/{mean,p50,p90,p99,max}`` of ``values``; empty when there are none."""
    ordered = sorted(values)
    if not ordered:
        return {}
    return {
        f"{prefix}/mean": sum(ordered) / len(ordered),
        f"{prefix}/p50": percentile(ordered, 50),
        f"{prefix}/p90": percentile(ordered, 90),
        f"{prefix}/p99": percentile(ordered, 99),
        f"{prefix}/max": ordered[-1],
    }


def lifecycle_metrics(completed: Sequence[CompletedRollout]) -> dict[str, float]:
    """Queue wait, run duration and total time percentiles of one step's rollouts."""
    if not completed:
        return {}
    queue = [r.running_at - r.enqueue_time for r in completed if r.running_at is not None]
    run = [
        r.finished_at - r.running_at
        for r in completed
        if r.running_at is not None and r.finished_at is not None
    ]
    total = [r.finished_at - r.enqueue_time for r in completed if r.finished_at is not None]
    return {
        **summary("timing/rollout_queue_wait_s", queue),
        **summary("timing/rollout_run_duration_s", run),
        **summary("timing/rollout_total_s", total),
        "timing/rollout_n_missing_running_ts": float(sum(r.running_at is None for r in completed)),
    }


__all__ = ("lifecycle_metrics", "percentile", "record_lifecycle", "summary")
