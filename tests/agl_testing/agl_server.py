"""Pytest fixtures that run the real execution-side server, ``agl-server``, on loopback.

The server lives in its own tool environment (it declares Python >= 3.12 and pins its
own web stack); ``scripts/test`` prepares it with ``python -m agl_trainer.local.provision``.
This module installs nothing: it finds the ``agl-server`` executable, starts it on a free
loopback port, waits for ``/healthz`` and stops it afterwards; without one, the fixtures skip
(fail under ``CI=true``). Standard library and pytest only, so it works in every package's own venv.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agl_testing.http import call
from agl_testing.requirements import missing_requirement

ROLLOUT_STATES = ("queuing", "running", "succeeded", "failed")
TEST_KEY = "agl-test-key"
TEST_MODEL_NAME = "agl-test-model"
_STARTUP_TIMEOUT_S = 60.0


class AglServerNotFound(RuntimeError):
    """No ``agl-server`` executable where the fixture looks; the message names the fix."""


def _tool_env_dir() -> Path:
    """The server's tool environment, where ``agl_trainer.local.envs`` provisions it:
    ``$AGL_CACHE_DIR``, else ``$XDG_CACHE_HOME/agl``, else ``~/.cache/agl``, then ``envs/agl-server``."""
    if explicit := os.environ.get("AGL_CACHE_DIR"):
        cache = Path(explicit).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        cache = (Path(xdg) if xdg else Path.home() / ".cache") / "agl"
    return cache / "envs" / "agl-server"


def find_agl_server() -> Path:
    """The ``agl-server`` executable: ``$AGL_SERVER_BIN``, the cached tool env, or ``PATH``."""
    if explicit := os.environ.get("AGL_SERVER_BIN"):
        if not Path(explicit).is_file():
            raise AglServerNotFound(f"AGL_SERVER_BIN={explicit} is not a file")
        return Path(explicit)
    env_dir = _tool_env_dir()
    cached = env_dir / "bin" / "agl-server"
    if cached.exists():
        return cached
    if on_path := shutil.which("agl-server"):
        return Path(on_path)
    raise AglServerNotFound(
        f"agl-server not found in {env_dir} nor on PATH: run "
        "`python -m agl_trainer.local.provision agl-server` or set AGL_SERVER_BIN"
    )


def require_agl_server() -> None:
    """Skip the test when no agl-server can be found, or fail it under ``CI=true``."""
    try:
        find_agl_server()
    except AglServerNotFound as exc:
        missing_requirement(str(exc))


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class AglServerProcess:
    """A running ``agl-server`` child process bound to 127.0.0.1."""

    key: str = TEST_KEY
    model_name: str = TEST_MODEL_NAME
    port: int = field(default_factory=free_loopback_port)
    _proc: subprocess.Popen[bytes] | None = None
    _workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="agl-server-")))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self._workdir / "server.log"

    def start(self) -> None:
        args = [
            str(find_agl_server()),
            "host=127.0.0.1",
            f"port={self.port}",
            f"key={self.key}",
            f"default_proxy.model_name={self.model_name}",
        ]
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(args, cwd=self._workdir, stdout=log, stderr=subprocess.STDOUT)
        self._wait_healthy()

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def rollout_ids(self) -> list[str]:
        """Every rollout the server holds, in any state."""
        query = "&".join(f"state_in={state}" for state in ROLLOUT_STATES)
        reply = call("GET", f"{self.url}/api/rollouts?{query}&limit=100000", key=self.key)
        assert reply.status == 200, f"listing rollouts answered {reply.status}: {reply.body}"
        return [r["rollout_id"] for r in reply.body]

    def delete_rollouts(self, rollout_ids: list[str]) -> None:
        for rid in rollout_ids:
            call("DELETE", f"{self.url}/api/rollouts/{rid}", key=self.key)

    def restart(self) -> None:
        """Stop and start again on the same port: the in-memory store comes back empty."""
        self.stop()
        self.start()

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"agl-server exited with {self._proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"agl-server not healthy after {_STARTUP_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def once_it_holds_a_rollout(server: AglServerProcess, action: Callable[[], None]) -> threading.Thread:
    """A daemon thread (not started) that runs ``action`` as soon as ``server`` holds a rollout."""

    def run() -> None:
        deadline = time.monotonic() + 60
        while not server.rollout_ids():
            assert time.monotonic() < deadline, "no rollout was created within 60 s"
            time.sleep(0.02)
        action()

    return threading.Thread(target=run, daemon=True)


def restart_once_it_holds_a_rollout(
    server: AglServerProcess, restarted: threading.Event, lost: set[str]
) -> threading.Thread:
    """:func:`once_it_holds_a_rollout` restarting ``server``: ``lost`` gets the ids it held, then
    ``restarted`` is set."""

    def restart() -> None:
        lost.update(server.rollout_ids())
        server.restart()
        restarted.set()

    return once_it_holds_a_rollout(server, restart)


@pytest.fixture(scope="session")
def shared_agl_server_process() -> Iterator[AglServerProcess]:
    """The one server process shared by the session; tests take it through ``agl_server``."""
    require_agl_server()
    server = AglServerProcess()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def agl_server(shared_agl_server_process: AglServerProcess) -> Iterator[AglServerProcess]:
    """The session's shared server, handed to one test at a time: it starts empty and the test
    must leave it empty (delete what it created), so no test ever sees another's rollouts. A
    test that leaves rollouts behind fails at teardown, and they are deleted for the next."""
    server = shared_agl_server_process
    assert server.is_running(), f"the shared agl-server died:\n{server.log_tail()}"
    if stale := server.rollout_ids():
        server.delete_rollouts(stale)
        pytest.fail(
            f"{len(stale)} rollout(s) appeared on the shared agl-server after the previous test's "
            f"teardown (a thread of an earlier test still creating them?): {stale[:10]}"
        )
    yield server
    left = server.rollout_ids()
    paused = call("GET", f"{server.url}/proxy/state", key=server.key).body.get("paused")
    if left:
        server.delete_rollouts(left)
    if paused:
        call("POST", f"{server.url}/proxy/resume", key=server.key)
    if left or paused:
        pytest.fail(
            f"the test left the shared agl-server dirty: {len(left)} rollout(s) {left[:10]}, "
            f"gateway {'paused' if paused else 'not paused'}"
        )


@pytest.fixture
def fresh_agl_server() -> Iterator[AglServerProcess]:
    """A real server of the test's own, for tests that assert on the whole store."""
    require_agl_server()
    server = AglServerProcess()
    server.start()
    yield server
    server.stop()
