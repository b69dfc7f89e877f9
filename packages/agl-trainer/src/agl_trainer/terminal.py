"""The terminal agl writes to, kept for agl alone while a run's other output goes to its log.

Inside :func:`quiet_terminal` the process's stdout and stderr (file descriptors 1 and 2, so also
what C extensions, Ray's forwarding of its workers' output and inheriting child processes write)
go to a file: a held temporary one, until :func:`send_output_to` names the run's log and moves
what was held there. agl's own lines, the progress bar and ERROR records of any logger are written
to :func:`terminal`, a duplicate of the descriptors from before. An unexpected error that ends
the block before any log was named shows what was held before its traceback; a ``SystemExit``
(agl's one-line errors) or Ctrl-C drops it.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TextIO


@dataclass(frozen=True)
class Terminal:
    """Where agl writes its standard output (``out``: start and end lines, a line per step) and its
    log lines, the progress bar and errors (``err``); one stream when both are the same file
    (a terminal, or ``2>&1``), so a line written to either clears the progress bar first."""

    out: TextIO
    err: TextIO


def terminal() -> Terminal:
    """The terminal kept by the active :func:`quiet_terminal`, else ``sys.stdout`` and ``sys.stderr``."""
    if _active is not None:
        return _active.terminal
    return Terminal(sys.stdout, sys.stderr)


class _ErrorsToTerminal(logging.Handler):
    """Writes ERROR records of third-party loggers to the terminal, above the progress bar."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=terminal().err)
        except Exception:  # logging's contract: report, never raise
            self.handleError(record)


@dataclass
class _Quiet:
    terminal: Terminal
    saved: tuple[int, int]
    held: BinaryIO
    log: Path | None = None
    errors: _ErrorsToTerminal = field(default_factory=_ErrorsToTerminal)
    error_loggers: list[logging.Logger] = field(default_factory=list[logging.Logger])


_active: _Quiet | None = None


def _terminal_streams(saved: tuple[int, int]) -> Terminal:
    def stream(fd: int) -> TextIO:
        return open(fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)

    if os.path.samestat(os.fstat(saved[0]), os.fstat(saved[1])):
        one = stream(saved[1])
        return Terminal(one, one)
    return Terminal(stream(saved[0]), stream(saved[1]))


def _point_output_at(fd: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)


@contextmanager
def quiet_terminal() -> Generator[None]:
    """Hold the process's stdout and stderr in a file until :func:`send_output_to` names the log;
    restore them when the block ends (see the module docstring). Not reentrant."""
    global _active
    if _active is not None:
        raise RuntimeError("quiet_terminal() is active already")
    saved = (os.dup(1), os.dup(2))
    held = tempfile.TemporaryFile()  # noqa: SIM115 (closed when the block ends)
    _active = quiet = _Quiet(_terminal_streams(saved), saved, held)
    _point_output_at(held.fileno())
    try:
        yield
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException:
        if quiet.log is None:
            sys.stdout.flush()
            sys.stderr.flush()
            quiet.terminal.err.flush()
            held.seek(0)
            shutil.copyfileobj(held, quiet.terminal.err.buffer)  # what led up to the error
            quiet.terminal.err.buffer.flush()
        raise
    finally:
        _point_output_at(saved[1])
        os.dup2(saved[0], 1)
        for logger in quiet.error_loggers:
            logger.removeHandler(quiet.errors)
        quiet.terminal.out.close()
        quiet.terminal.err.close()
        os.close(saved[0])
        os.close(saved[1])
        held.close()
        _active = None


def send_output_to(log: Path) -> bool:
    """Append the active :func:`quiet_terminal`'s stdout and stderr to ``log``, starting with what it
    held, and show ERROR records of any logger on the terminal too; False (and nothing changes)
    when no :func:`quiet_terminal` is active."""
    quiet = _active
    if quiet is None:
        return False
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        quiet.held.seek(0)
        with open(fd, "ab", closefd=False) as file:
            shutil.copyfileobj(quiet.held, file)
        _point_output_at(fd)
    finally:
        os.close(fd)
    quiet.held.truncate(0)
    quiet.log = log
    root = logging.getLogger()
    if not root.handlers:  # keep warnings going where logging's last resort sends them: the log
        root.addHandler(logging.StreamHandler())
    quiet.error_loggers = [root, *_non_propagating_loggers()]
    for logger in quiet.error_loggers:
        logger.addHandler(quiet.errors)
    return True


def _non_propagating_loggers() -> list[logging.Logger]:
    """Loggers whose records never reach the root (Ray's, and agl's, which show on the terminal already)."""
    return [
        logger
        for name, logger in logging.Logger.manager.loggerDict.items()
        if isinstance(logger, logging.Logger) and not logger.propagate and not name.startswith("agl")
    ]


__all__ = ("Terminal", "quiet_terminal", "send_output_to", "terminal")
