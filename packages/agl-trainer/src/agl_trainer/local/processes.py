"""Child servers: free loopback ports, start in a process group, wait until healthy, stop.

Every child runs in its own session (process group), so stopping it also stops what it spawned
(vLLM's engine core). ``stop`` sends SIGTERM to the group, waits a grace period, then SIGKILL.
Children still alive when the interpreter exits are stopped by an ``atexit`` hook, and on Linux
each child also gets SIGTERM if the thread that started it dies (``PR_SET_PDEATHSIG``), so a
killed trainer leaves no server behind.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import httpx

from agl_trainer.local.errors import ProcessStartError

LOOPBACK = "127.0.0.1"
_PR_SET_PDEATHSIG = 1
_live: set[ChildProcess] = set()
_live_lock = threading.Lock()


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on ``host`` that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def exit_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit`` in the main thread, so ``with`` blocks stop the children."""
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(128 + signal.SIGTERM))


class ChildProcess:
    """One server process, its log file and its lifecycle."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        cwd: Path,
        log_path: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.cwd = cwd
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self._process: subprocess.Popen[bytes] | None = None
        self.stopping = False
        """Set once :meth:`stop` was called: an exit from then on is not a death."""

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def running(self) -> bool:
        return self._process is not None and self.exit_code is None

    @property
    def exit_code(self) -> int | None:
        """The exit code once the process ended (negative: the signal that killed it), else None.

        It does not reap the process (another thread may be in :meth:`stop`, which must reap it last).
        """
        process = self._process
        if process is None or process.returncode is not None:
            return None if process is None else process.returncode
        try:
            info = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped meanwhile by stop()
            return process.returncode
        if info is None:
            return None
        killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        return -info.si_status if killed else info.si_status

    def start(self) -> ChildProcess:
        """Spawn the process in a new session with stdout and stderr going to ``log_path``."""
        if self._process is not None:
            raise RuntimeError(f"{self.name} was already started (pid {self._process.pid})")
        self.cwd.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        with _live_lock:
            _live.add(self)
        return self

    def wait_healthy(self, url: str, timeout: float, interval: float = 0.5) -> None:
        """Poll ``GET url`` until it answers 200; fail fast if the process exits first."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5.0) as client:
            while True:
                code = self.exit_code
                if code is not None:
                    raise ProcessStartError(
                        f"{self.name} exited with code {code} before {url} answered; "
                        f"last lines of {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    if client.get(url).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() >= deadline:
                    raise ProcessStartError(
                        f"{self.name} did not answer 200 on {url} within {timeout:.0f} s "
                        f"(fix: raise the start timeout, or read {self.log_path}); last lines:\n{self.log_tail()}"
                    )
                time.sleep(interval)

    def wait_exit(self, timeout: float) -> int | None:
        """The exit code if the process ends within ``timeout`` seconds, else None (still running)."""
        if self._process is None:
            raise RuntimeError(f"{self.name} was never started")
        if not _wait_unreaped(self._process.pid, timeout):
            return None
        return self.exit_code  # unreaped: stop() still finds the group by the leader's pid

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the child's log (empty if none yet)."""
        if not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds; idempotent.

        A process that died on its own is reaped here too, once what of its group outlived it is
        killed (a SIGKILLed vLLM leaves its engine core and workers running, 2 GB or more).
        Returns the exit code, or None if the process was never started.
        """
        self.stopping = True
        process = self._process
        if process is None:
            return None
        if process.returncode is None:  # not reaped yet (nothing else here reaps it)
            if self.exit_code is None:
                _signal_group(process.pid, signal.SIGTERM)
                if not _wait_unreaped(process.pid, grace):
                    _signal_group(process.pid, signal.SIGKILL)
            # The leader is a zombie now, so its pid (the group id) cannot be reused yet: kill
            # whatever of its group outlived it (vLLM's engine core), then reap it.
            _signal_group(process.pid, signal.SIGKILL)
            process.wait()
        with _live_lock:
            _live.discard(self)
        return process.returncode

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _wait_unreaped(pid: int, timeout: float) -> bool:
    """Wait until ``pid`` exits without reaping it; False on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:  # already reaped
            return True
        time.sleep(0.05)
    return False


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


@atexit.register
def _stop_all() -> None:
    with _live_lock:
        children = list(_live)
    for child in children:
        child.stop(grace=5.0)
