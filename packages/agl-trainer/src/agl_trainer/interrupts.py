"""Ctrl-C: heard however the process was started (:func:`hear_ctrl_c`), and held off a clean-up
that it must not cut short (:func:`ctrl_c_held`).

A shell without job control starts a background command (``cmd &`` in a script, as many CI runners
and launch scripts do) with SIGINT ignored, and Python keeps an ignored SIGINT ignored. agl-trainer
so started would lose the user's Ctrl-C, and the embedded default's supervisor, which interrupts the
main thread with SIGINT when a vital process dies, would go unheard.

The end of a run cancels its rollouts on agl-server and resumes the gateway. A user who presses
Ctrl-C again while that runs (the first press is what ended the run) would otherwise leave rollouts
queued for the agents and the gateway paused for the next run. The clean-up is short (its calls
are retried briefly), so the press waits for it; a further press is let through at once.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Generator
from contextlib import contextmanager
from types import FrameType
from typing import Any

logger = logging.getLogger("agl_trainer")
SigintHandler = Callable[[int, FrameType | None], Any] | int | None


def hear_ctrl_c() -> SigintHandler:
    """Make SIGINT raise ``KeyboardInterrupt`` in the main thread when no Python handler takes it
    (it was ignored or left to the OS); return the handler it had. Call from the main thread."""
    inherited = signal.getsignal(signal.SIGINT)
    if not callable(inherited):
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return inherited


@contextmanager
def ctrl_c_held() -> Generator[None]:
    """Hold the first SIGINT that arrives inside the block, and deliver it once the block is done
    (``KeyboardInterrupt`` under Python's default handler); a second one is delivered at once.
    Off the main thread, where no handler can be set, the block runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    presses: list[int] = []

    def deliver(frame: FrameType | None) -> None:
        if callable(previous):
            previous(signal.SIGINT, frame)
        elif previous != signal.SIG_IGN:  # SIG_DFL, or a handler not set from Python
            raise KeyboardInterrupt

    def hold(signum: int, frame: FrameType | None) -> None:
        presses.append(signum)
        if len(presses) > 1:
            deliver(frame)
            return
        logger.warning(
            "Ctrl-C: cancelling this run's rollouts on agl-server and resuming the gateway first "
            "(a few seconds); press it again to leave them"
        )

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if len(presses) == 1:
        deliver(None)


__all__ = ("SigintHandler", "ctrl_c_held", "hear_ctrl_c")
