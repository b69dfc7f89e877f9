"""Waiting on a :class:`~agl_rollout.GroupCollector`'s thread: tests step it to a known point.

A wait fails at once with the thread's own error (the :class:`~agl_rollout.CollectorError` that
``take`` would raise) and with ``TimeoutError`` when the point is not reached in time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from agl_rollout import GroupCollector

POLL_S = 0.01


def wait_polls(collector: GroupCollector, n: int, *, timeout_s: float) -> None:
    """Block until the collector's thread has finished ``n`` more sweeps."""
    target = collector.n_polls + n
    _wait(collector, lambda: collector.n_polls >= target, f"{n} more sweeps", timeout_s)


def wait_complete(collector: GroupCollector, n_groups: int, *, timeout_s: float) -> None:
    """Block until at least ``n_groups`` complete groups are ready to be taken."""
    _wait(collector, lambda: collector.n_complete >= n_groups, f"{n_groups} complete groups", timeout_s)


def _wait(collector: GroupCollector, done: Callable[[], bool], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        collector._raise_error()  # pyright: ignore[reportPrivateUsage]
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the collector did not reach {what} within {timeout_s} s")
        time.sleep(POLL_S)
