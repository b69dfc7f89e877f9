"""Ctrl-C as Python's ``KeyboardInterrupt``, whatever SIGINT disposition the process inherited.

A shell without job control starts a background command (``cmd &`` in a script, as many CI runners
and launch scripts do) with SIGINT ignored, and Python keeps an ignored SIGINT ignored. agl-trainer
so started would lose the user's Ctrl-C, and the embedded default's supervisor, which interrupts the
main thread with SIGINT when a vital process dies, would go unheard.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType
from typing import Any

SigintHandler = Callable[[int, FrameType | None], Any] | int | None


def hear_ctrl_c() -> SigintHandler:
    """Make SIGINT raise ``KeyboardInterrupt`` in the main thread when no Python handler takes it
    (it was ignored or left to the OS); return the handler it had. Call from the main thread."""
    inherited = signal.getsignal(signal.SIGINT)
    if not callable(inherited):
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return inherited


__all__ = ("SigintHandler", "hear_ctrl_c")
