"""The supervisor of the embedded default's processes, with the real agl-server and agl-controller
SIGKILLed under it (vLLM's death is seen through the whole command in ``test_trainer_local_own_agent.py``)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agl_rollout import AglClient, RolloutManagerConfig, SyncRolloutManager
from agl_testing.requirements import missing_requirement
from agl_trainer.local import (
    AglController,
    Supervisor,
    agl_server_spec,
    existing_tool_env,
    start_agl_server,
    start_controller,
)
from agl_trainer.local.processes import LOOPBACK, ChildProcess, free_port
from agl_trainer.local.services import VllmServer
from agl_types import RolloutState

pytestmark = [pytest.mark.server, pytest.mark.slow]

SCRIPTED_AGENTS = Path(__file__).parent / "controller_agents"


def server_python() -> Path:
    env = existing_tool_env(agl_server_spec())
    if env is None:
        missing_requirement("no agl-server tool environment; run agl-trainer once to provision it")
    return env.python


SCRIPTED = RolloutManagerConfig(
    rollout_timeout_seconds=120,
    poll_interval_seconds=0.05,
    local_agent_class="agl_scripted_agents:ScriptedAgent",
    local_env_map={"AGL_TEST_INPUT": "input"},
)


def _kill(pid: int | None) -> None:
    assert pid is not None
    os.kill(pid, signal.SIGKILL)


@pytest.fixture(params=["default", "ignored"])
def inherited_sigint(request: pytest.FixtureRequest) -> Iterator[Any]:
    """SIGINT as the process was handed it: Python's default, or ignored, as a shell without job
    control hands it to a command it runs in the background (``cmd &``: CI runners, scripts)."""
    handler = signal.default_int_handler if request.param == "default" else signal.SIG_IGN
    before = signal.signal(signal.SIGINT, handler)
    try:
        yield handler
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.timeout(120)
def test_a_killed_agl_server_interrupts_the_main_thread_within_seconds_naming_its_exit_code_and_log(
    tmp_path: Path, inherited_sigint: Any
) -> None:
    with start_agl_server(server_python(), tmp_path) as server, Supervisor() as supervisor:
        supervisor.watch(server.process)
        killed_at = time.monotonic()
        _kill(server.process.pid)
        with pytest.raises(KeyboardInterrupt):
            time.sleep(30)
        # Generous for a loaded 2-core machine; the supervisor checks every 0.5 s.
        assert time.monotonic() - killed_at < 5
    assert signal.getsignal(signal.SIGINT) is inherited_sigint  # given back as it was handed
    assert (
        supervisor.failure
        == f"agl-server exited with code -9 during the run; its log: {tmp_path / 'agl-server.log'}"
    )


@pytest.mark.timeout(120)
def test_a_process_stopped_on_purpose_is_no_failure(tmp_path: Path) -> None:
    failures: list[str] = []
    with start_agl_server(server_python(), tmp_path) as server, Supervisor(interval=0.05) as supervisor:
        supervisor.on_failure = lambda: failures.append(str(supervisor.failure))
        supervisor.watch(server.process)
        server.stop()
        time.sleep(0.5)
    assert (failures, supervisor.check()) == ([], None)


@pytest.mark.timeout(180)
def test_a_killed_controller_is_restarted_and_the_new_one_fails_what_the_old_one_ran(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows: list[dict[str, Any]] = [
        {"do": "hang", "seconds": 5},
        {"do": "hang", "seconds": 5},
        {"do": "reward", "x": 1},
    ]
    with (
        start_agl_server(server_python(), tmp_path / "server") as server,
        AglClient(server.url, server.key) as client,
        start_controller(
            server_python(), server, tmp_path / "ctl", maximum_size=2, python_path=[SCRIPTED_AGENTS]
        ) as controller,
        Supervisor(max_restarts=2) as supervisor,
    ):
        supervisor.watch_controller(controller)
        first_pid = controller.process.pid
        killer = threading.Thread(target=_kill_when_running, args=(client, controller))
        killer.start()
        with caplog.at_level(logging.WARNING, logger="agl_trainer.local.supervisor"):
            result = SyncRolloutManager(client, SCRIPTED).enqueue_and_wait_until_completed(
                rows, is_train=True
            )
        killer.join()
        assert controller.process.running and controller.process.pid != first_pid
    outcomes = sorted((r.input["do"], r.rollout_state, r.error_message) for r in result.completed)
    assert outcomes == [
        ("hang", RolloutState.FAILED, "local subprocess is not running"),
        ("hang", RolloutState.FAILED, "local subprocess is not running"),
        ("reward", RolloutState.SUCCEEDED, None),
    ]
    assert (supervisor.restarts, supervisor.failure) == (1, None)
    assert caplog.messages == [
        "agl-controller exited with code -9; restarting it (restart 1 of 2, controller_restarts=2); "
        f"its log: {tmp_path / 'ctl' / 'agl-controller.log'}"
    ]


@pytest.mark.timeout(120)
def test_a_controller_dying_once_more_than_allowed_stops_the_run(tmp_path: Path) -> None:
    failed = threading.Event()
    with (
        start_agl_server(server_python(), tmp_path / "server") as server,
        start_controller(server_python(), server, tmp_path / "ctl", maximum_size=1) as controller,
        Supervisor(max_restarts=0, interval=0.05, on_failure=failed.set) as supervisor,
    ):
        supervisor.watch_controller(controller)
        _kill(controller.process.pid)
        assert failed.wait(5)
    assert supervisor.failure == (
        "agl-controller exited with code -9 during the run after 0 restarts (controller_restarts=0); "
        f"its log: {tmp_path / 'ctl' / 'agl-controller.log'}"
    )


def _kill_when_running(client: AglClient, controller: AglController) -> None:
    """SIGKILL the controller (not its agents, in sessions of their own) once it runs two agents."""
    deadline = time.monotonic() + 60
    while len(client.list_rollouts([RolloutState.RUNNING])) < 2:
        assert time.monotonic() < deadline, "the controller did not start 2 agents within 60 s"
        time.sleep(0.05)
    _kill(controller.process.pid)


def _vllm_stand_in(tmp_path: Path) -> VllmServer:
    """A process in the place of a vLLM server (Python's HTTP server on a loopback port): what is
    under test is the supervisor's restart of the process, the same command on the same port."""
    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", LOOPBACK]
    child = ChildProcess("vllm", argv, cwd=tmp_path, log_path=tmp_path / "vllm-1.log").start()
    child.wait_healthy(f"http://{LOOPBACK}:{port}/", timeout=30)
    return VllmServer(url=f"http://{LOOPBACK}:{port}", served_model_name="m", process=child)


@pytest.mark.timeout(120)
def test_a_killed_vllm_of_several_is_restarted_on_its_port_counted_and_the_run_goes_on_until_restarts_run_out(
    tmp_path: Path,
) -> None:
    failures: list[str] = []
    server = _vllm_stand_in(tmp_path)
    try:
        with Supervisor(interval=0.05, max_vllm_restarts=1) as supervisor:
            supervisor.on_failure = lambda: failures.append(str(supervisor.failure))
            supervisor.watch_vllm(server)
            first_pid = server.process.pid
            _kill(first_pid)
            deadline = time.monotonic() + 10
            while server.process.pid == first_pid and time.monotonic() < deadline:
                time.sleep(0.05)
            server.process.wait_healthy(f"{server.url}/", timeout=30)
            restarted = (supervisor.vllm_restarts, list(failures), server.process.pid != first_pid)
            _kill(server.process.pid)
            deadline = time.monotonic() + 10
            while not failures and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        server.stop()
    assert restarted == (1, [], True)
    assert failures == [f"vllm exited with code -9 during the run; its log: {tmp_path / 'vllm-1.log'}"]
