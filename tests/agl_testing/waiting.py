"""Polling with a deadline: every wait in the tests ends, and says what it waited for."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    condition: Callable[[], bool], what: str, timeout_s: float = 60.0, poll_s: float = 0.02
) -> None:
    """Return once ``condition()`` holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s:g} s"
        time.sleep(poll_s)
