"""A live progress line while waiting: a rewritten line on a TTY, periodic log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

logger = logging.getLogger("agl_rollout.progress")

_LOG_EVERY_S = 10.0


class WaitProgress:
    """Reports ``done/total`` with outcome counts and elapsed time of one wait.

    ``enabled=None`` draws the live line only when ``stream`` is a TTY; without it (CI, log
    files) a structured log line is written at most every 10 s and once at the end.
    """

    def __init__(
        self, label: str, total: int, *, enabled: bool | None = None, stream: TextIO | None = None
    ) -> None:
        self.label = label
        self.total = total
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty() if enabled is None else enabled
        self.started = time.monotonic()
        self._last_log = self.started

    def update(self, done: int, succeeded: int, failed: int, timed_out: int, oldest_wait_s: float) -> None:
        elapsed = time.monotonic() - self.started
        if self.live:
            line = (
                f"\r{self.label}: {done}/{self.total} done  ok={succeeded} failed={failed} "
                f"timed_out={timed_out}  elapsed={elapsed:.0f}s oldest_pending={oldest_wait_s:.0f}s"
            )
            self.stream.write(line)
            self.stream.flush()
        elif time.monotonic() - self._last_log >= _LOG_EVERY_S:
            self._last_log = time.monotonic()
            self._log(done, succeeded, failed, timed_out, elapsed)

    def close(self, done: int, succeeded: int, failed: int, timed_out: int) -> None:
        elapsed = time.monotonic() - self.started
        if self.live:
            self.stream.write("\n")
            self.stream.flush()
        self._log(done, succeeded, failed, timed_out, elapsed)

    def _log(self, done: int, succeeded: int, failed: int, timed_out: int, elapsed: float) -> None:
        logger.info(
            "%s progress done=%d total=%d succeeded=%d failed=%d timed_out=%d elapsed_s=%.1f",
            self.label,
            done,
            self.total,
            succeeded,
            failed,
            timed_out,
            elapsed,
        )


__all__ = ("WaitProgress",)
