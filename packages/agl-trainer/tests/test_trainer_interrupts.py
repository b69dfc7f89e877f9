"""``ctrl_c_held``: a Ctrl-C during the end-of-run clean-up waits for it; a further one does not.

The presses are real SIGINTs to this process, under Python's default handler."""

from __future__ import annotations

import signal

import pytest

from agl_trainer.interrupts import ctrl_c_held


def test_a_ctrl_c_during_the_clean_up_is_raised_once_it_is_done() -> None:
    done: list[str] = []
    with pytest.raises(KeyboardInterrupt), ctrl_c_held():
        signal.raise_signal(signal.SIGINT)
        done.append("cancelled")
        done.append("resumed")
    assert done == ["cancelled", "resumed"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_during_the_clean_up_is_raised_at_once() -> None:
    done: list[str] = []
    with pytest.raises(KeyboardInterrupt), ctrl_c_held():
        signal.raise_signal(signal.SIGINT)
        done.append("cancelled")
        signal.raise_signal(signal.SIGINT)
        done.append("resumed")
    assert done == ["cancelled"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_clean_up_without_ctrl_c_raises_nothing() -> None:
    with ctrl_c_held():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
