"""Child-process management: ports, health wait, log tails, and stopping whole process groups."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agl_testing.waiting import wait_until
from agl_trainer.local import ChildProcess, ProcessStartError, free_port


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it no longer runs.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def _wait_for_file(path: Path, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.05)
    raise AssertionError(f"{path} did not appear within {timeout_s} s")


def _as_a_foreground_process_starts() -> None:
    """SIGINT back to its default, so Python turns it into KeyboardInterrupt: a test runner started
    in the background (``cmd &``, as CI and scripts often are) hands its children SIGINT ignored,
    and a Python started so ignores Ctrl-C for good."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_free_port_is_bindable_on_loopback() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_wait_healthy_returns_once_server_answers(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    with ChildProcess("http", argv, cwd=tmp_path, log_path=tmp_path / "http.log").start() as child:
        child.wait_healthy(f"http://127.0.0.1:{port}/", timeout=30)
        assert child.running
    assert not child.running


def test_wait_healthy_reports_exit_code_and_log_tail(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; print('boom: bad flag'); sys.exit(3)"]
    child = ChildProcess("broken", argv, cwd=tmp_path, log_path=tmp_path / "b.log").start()
    with pytest.raises(ProcessStartError, match=r"broken exited with code 3 before .*\n.*boom: bad flag"):
        child.wait_healthy(f"http://127.0.0.1:{free_port()}/", timeout=30)


def test_wait_healthy_times_out_with_log_tail(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import time; print('still loading', flush=True); time.sleep(60)"]
    with ChildProcess("slow", argv, cwd=tmp_path, log_path=tmp_path / "s.log").start() as child:
        _wait_for_file(tmp_path / "s.log")
        with pytest.raises(
            ProcessStartError, match=r"slow did not answer 200 .* within 0 s(.|\n)*still loading"
        ):
            child.wait_healthy(f"http://127.0.0.1:{free_port()}/", timeout=0.2, interval=0.05)


def test_stop_kills_grandchildren_of_the_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    script = textwrap.dedent(
        f"""
        import subprocess, sys, time
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open({str(pid_file)!r}, "w").write(str(grandchild.pid))
        time.sleep(120)
        """
    )
    child = ChildProcess("parent", [sys.executable, "-c", script], cwd=tmp_path, log_path=tmp_path / "p.log")
    child.start()
    grandchild = int(_wait_for_file(pid_file))
    assert _pid_alive(grandchild)
    child.stop(grace=5)
    wait_until(lambda: not _pid_alive(grandchild), "the grandchild's exit")


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    script = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(ready)!r}, 'w').write('1'); time.sleep(120)"
    )
    child = ChildProcess(
        "stubborn", [sys.executable, "-c", script], cwd=tmp_path, log_path=tmp_path / "x.log"
    )
    child.start()
    _wait_for_file(ready)
    assert child.stop(grace=0.3) == -signal.SIGKILL


def test_stop_is_idempotent_and_returns_exit_code(tmp_path: Path) -> None:
    child = ChildProcess("quick", [sys.executable, "-c", "pass"], cwd=tmp_path, log_path=tmp_path / "q.log")
    assert child.stop() is None
    child.start()
    wait_until(lambda: not child.running, "the child's exit")
    assert child.stop() == 0
    assert child.stop() == 0


def test_start_twice_is_refused(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(30)"]
    child = ChildProcess("twice", argv, cwd=tmp_path, log_path=tmp_path / "t.log").start()
    with child, pytest.raises(RuntimeError, match="twice was already started"):
        child.start()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_parent_stops_its_children(tmp_path: Path, signum: signal.Signals) -> None:
    pid_file = tmp_path / "child.pid"
    driver = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from agl_trainer.local import ChildProcess, exit_on_sigterm
        exit_on_sigterm()
        argv = [sys.executable, "-c", "import time; time.sleep(120)"]
        with ChildProcess("sleeper", argv, cwd=Path({str(tmp_path)!r}), log_path=Path({str(tmp_path)!r}) / "c.log").start() as c:
            Path({str(pid_file)!r}).write_text(str(c.pid))
            time.sleep(120)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", driver], preexec_fn=_as_a_foreground_process_starts)
    child_pid = int(_wait_for_file(pid_file))
    assert _pid_alive(child_pid)
    parent.send_signal(signum)
    # The parent's stop gives its child 10 s of grace; a loaded machine gets ample margin on top.
    assert parent.wait(timeout=120) != 0
    assert not _pid_alive(child_pid)


def test_a_child_that_was_killed_has_what_outlived_it_in_its_group_killed_when_stopped(
    tmp_path: Path,
) -> None:
    """As a SIGKILLed vLLM leaves its engine core running: the leader dies, its group lives on."""
    pid_file = tmp_path / "grandchild.pid"
    leader = textwrap.dedent(
        f"""
        import subprocess, sys, time
        from pathlib import Path
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        Path({str(pid_file)!r}).write_text(str(grandchild.pid))
        time.sleep(120)
        """
    )
    child = ChildProcess("leader", [sys.executable, "-c", leader], cwd=tmp_path, log_path=tmp_path / "l.log")
    with child.start():
        grandchild = int(_wait_for_file(pid_file))
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait_exit(30) == -signal.SIGKILL
        assert _pid_alive(grandchild)
    deadline = time.monotonic() + 10
    while _pid_alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pid_alive(grandchild)
