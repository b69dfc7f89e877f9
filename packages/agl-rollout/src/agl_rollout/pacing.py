"""How long a sync wait pauses between sweeps.

A sync wait is done only when its last rollout is, so sweeping every poll interval while most of
the wave is still running costs server requests (two per sweep) and gains nothing. The pause is
the poll interval, stretched while the wave is young and far from done: to at most a third of the
time waited so far, a third of the estimated time left (pending rollouts over the finish rate seen
so far) and ``max_poll_interval_seconds``. Near the end the estimate falls under the poll interval,
so a wave that finishes steadily is seen done as promptly as with a fixed interval; when all that
is left finishes at once right after a sweep, the wait learns of it at most one stretched pause late.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

STRETCH_FRACTION = 1 / 3
"""The pause is at most this fraction of the time waited, and of the estimated time left."""


@dataclass
class SweepPacer:
    """The pause before the next sweep of one wait, from how much of it is done and how fast;
    the wait started when the pacer was made (``clock`` is for tests)."""

    poll_interval_seconds: float
    max_poll_interval_seconds: float
    clock: Callable[[], float] = time.monotonic
    started: float = field(init=False)

    def __post_init__(self) -> None:
        self.started = self.clock()

    def pause(self, n_done: int, n_pending: int) -> float:
        elapsed = self.clock() - self.started
        time_left = math.inf if n_done == 0 else n_pending * elapsed / n_done
        stretched = STRETCH_FRACTION * min(elapsed, time_left)
        return max(self.poll_interval_seconds, min(self.max_poll_interval_seconds, stretched))


__all__ = ("STRETCH_FRACTION", "SweepPacer")
