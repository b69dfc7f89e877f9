"""A live progress line while waiting: a rewritten line on a TTY, periodic log lines otherwise.

Hand-made rather than tqdm or rich: one line is all a wait needs, and agl-rollout keeps its
dependencies to httpx and agl-types.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from agl_rollout._tracker import WaitCounts
from agl_types import EnqueuedRollout

logger = logging.getLogger("agl_rollout.progress")

_LOG_EVERY_S = 10.0
_CLEAR_TO_EOL = "\x1b[K"  # a shorter line must not leave the tail of the previous one


def _mean(values: Sequence[float]) -> str:
    return f"{sum(values) / len(values):.1f}s" if values else "-"


class WaitProgress:
    """Reports one wait: ``done/total``, outcomes, pending rollouts queued and running, the mean
    queue wait and run time of the rollouts finished so far, the oldest pending rollout's age
    and the elapsed time.

    ``enabled=None`` draws the live line only when ``stream`` is a TTY; otherwise (CI, log
    files) nothing is written to ``stream`` and a structured log line goes out at most every
    10 s, and once at the end of a wait that logged one: a wait over in seconds says nothing.
    ``clock`` is the wall clock (``EnqueuedRollout.enqueue_time``'s).
    """

    def __init__(
        self,
        label: str,
        total: int,
        *,
        enabled: bool | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.label = label
        self.total = total
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty() if enabled is None else enabled
        self.clock = clock
        self.started = clock()
        self._last_log = self.started
        self._logged = False

    def update(self, done: int, counts: WaitCounts, pending: Mapping[str, EnqueuedRollout]) -> None:
        now = self.clock()
        n_queued = sum(record.running_at is None for record in pending.values())
        oldest = min((record.enqueue_time for record in pending.values()), default=now)
        fields = {
            "queued": str(n_queued),
            "running": str(len(pending) - n_queued),
            "mean_queue_wait": _mean(counts.queue_wait_s),
            "mean_run": _mean(counts.run_s),
            "oldest_pending": f"{now - oldest:.0f}s",
        }
        if self.live:
            self.stream.write(f"\r{self._line(done, counts, fields, now)}{_CLEAR_TO_EOL}")
            self.stream.flush()
        elif now - self._last_log >= _LOG_EVERY_S:
            self._last_log = now
            self._log(done, counts, fields, now)

    def close(self, done: int, counts: WaitCounts) -> None:
        now = self.clock()
        fields = {"mean_queue_wait": _mean(counts.queue_wait_s), "mean_run": _mean(counts.run_s)}
        if self.live:
            self.stream.write(f"\r{self._line(done, counts, fields, now)}{_CLEAR_TO_EOL}\n")
            self.stream.flush()
        elif self._logged:
            self._log(done, counts, fields, now)

    def _line(self, done: int, counts: WaitCounts, fields: dict[str, str], now: float) -> str:
        outcomes = f"ok={counts.n_succeeded} failed={counts.n_failed} timed_out={counts.n_timed_out}"
        details = " ".join(f"{key}={value}" for key, value in fields.items())
        return f"{self.label}: {done}/{self.total} done  {outcomes}  {details}  elapsed={now - self.started:.0f}s"

    def _log(self, done: int, counts: WaitCounts, fields: dict[str, str], now: float) -> None:
        self._logged = True
        details = " ".join(f"{key}={value}" for key, value in fields.items())
        logger.info(
            "%s progress done=%d total=%d succeeded=%d failed=%d timed_out=%d %s elapsed_s=%.1f",
            self.label,
            done,
            self.total,
            counts.n_succeeded,
            counts.n_failed,
            counts.n_timed_out,
            details,
            now - self.started,
        )


__all__ = ("WaitProgress",)
