"""The real agl-controller running agents for agl: its command line, the toy agent classes, and every
way an agent can end, seen through the trainer's sync manager against the real agl-server.

The agents of the fault cases are ``controller_agents/agl_scripted_agents.py``, imported by the
controller's workers from the agl-server tool environment; the toy agents' run through the gateway
and a trainer step is in ``tests/e2e/test_e2e_local.py``, which has a real vLLM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agl_rollout import AglClient, RolloutManagerConfig, SyncRolloutManager
from agl_testing.key_scan import KeyScan
from agl_testing.requirements import missing_requirement
from agl_trainer.local import (
    AGENT_CLASSES,
    AgentImportError,
    AglController,
    AglServer,
    DigitsAgent,
    ToolLatency,
    agent_import_path,
    agents_python_path,
    agl_controller_argv,
    agl_server_spec,
    check_agent_class,
    controller_env,
    existing_tool_env,
    start_agl_server,
    start_controller,
    toy_env_map,
)
from agl_types import RolloutCreate, RolloutState

SCRIPTED_AGENTS = Path(__file__).parent / "controller_agents"
SCRIPTED_AGENT_CLASS = "agl_scripted_agents:ScriptedAgent"


def scripted_config(rollout_timeout_seconds: float) -> RolloutManagerConfig:
    """The sync manager's config for rollouts run by :data:`SCRIPTED_AGENT_CLASS`."""
    return RolloutManagerConfig(
        rollout_timeout_seconds=rollout_timeout_seconds,
        poll_interval_seconds=0.05,
        local_agent_class=SCRIPTED_AGENT_CLASS,
        local_env_map={"AGL_TEST_INPUT": "input"},
    )


def server_python() -> Path:
    env = existing_tool_env(agl_server_spec())
    if env is None:
        missing_requirement("no agl-server tool environment; run agl-trainer once to provision it")
    return env.python


def test_controller_argv_runs_local_mode_against_the_server_with_hydra_outputs_off() -> None:
    argv = agl_controller_argv(
        Path("/env/bin/python"),
        server_url="http://127.0.0.1:9",
        maximum_size=16,
        poll_interval=0.2,
        workdir=Path("/run"),
    )
    assert argv == [
        "/env/bin/python",
        "-m",
        "agentlightning.controller",
        "runner_type=local",
        "agl_server.url=http://127.0.0.1:9",
        "agl_server.key=${oc.env:AGL_KEY}",
        "local_runner.maximum_size=16",
        "local_runner.poll_interval=0.2",
        "hydra.run.dir=/run",
        "hydra.output_subdir=null",
        "hydra/job_logging=disabled",
    ]


@pytest.mark.parametrize(
    ("size", "interval", "field"), [(0, 0.2, "maximum_size=0"), (4, 0.0, "poll_interval=0.0")]
)
def test_controller_argv_names_a_bad_pool_size_or_tick(size: int, interval: float, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        agl_controller_argv(
            Path("python"),
            server_url="u",
            maximum_size=size,
            poll_interval=interval,
            workdir=Path("."),
        )


def test_toy_env_map_passes_the_whole_input_the_model_folder_and_the_tool_latency() -> None:
    assert toy_env_map(Path("/models/tiny")) == {"AGL_TOY_INPUT": "input", "AGL_TOY_MODEL": "/models/tiny"}
    assert toy_env_map(Path("/m"), ToolLatency(0.5, 6.0))["AGL_TOY_TOOL_LATENCY"] == "0.5:6.0"


def test_a_toy_agent_outside_the_controller_names_the_missing_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("AGL_OPENAI_BASE_URL", "AGL_EVENT_URL", "AGL_KEY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="AGL_OPENAI_BASE_URL is not set"):
        DigitsAgent().run()


@pytest.mark.server
def test_toy_agent_classes_import_in_the_agl_server_environment_through_the_linked_package(
    tmp_path: Path,
) -> None:
    probe = (
        "import importlib, sys; "
        "[getattr(importlib.import_module(m), c) for m, c in (p.split(':') for p in sys.argv[1:])]; "
        "print(sys.modules['agl_trainer'].__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(agent_import_path(tmp_path))}
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run(
        [str(server_python()), "-c", probe, *AGENT_CLASSES.values()],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "agent-path" / "agl_trainer" / "__init__.py")


def test_agents_python_path_is_the_given_folders_then_the_users_pythonpath_then_the_start_folder() -> None:
    base = {"PYTHONPATH": os.pathsep.join(["/abs/agents", "rel/agents", "", "/given"])}
    assert agents_python_path([Path("/given")], base, Path("/home/u/project")) == [
        "/given",
        "/abs/agents",
        "/home/u/project/rel/agents",
        "/home/u/project",
    ]


def test_controller_env_carries_the_key_and_the_agents_python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir("/")
    env = controller_env("s3cret", [Path("/toy")], base={"PYTHONPATH": "/mine", "VIRTUAL_ENV": "/v"})
    assert env == {"PYTHONPATH": os.pathsep.join(["/toy", "/mine", "/"]), "AGL_KEY": "s3cret"}


@pytest.mark.server
def test_an_agent_class_the_controller_cannot_import_is_one_line_naming_the_module_and_the_paths_searched(
    tmp_path: Path,
) -> None:
    env = controller_env("", [tmp_path / "agents"], base={"PATH": os.environ["PATH"]}, cwd=tmp_path)
    with pytest.raises(AgentImportError) as raised:
        check_agent_class(server_python(), "my_agents:DigitAgent", env, tmp_path / "run")
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(
        f"agentlightning.local.agent_class=my_agents:DigitAgent cannot be imported by agl-controller's Python "
        f"({server_python()}): ModuleNotFoundError: No module named 'my_agents'; paths searched: "
        f"{tmp_path / 'run'}{os.pathsep}{tmp_path / 'agents'}{os.pathsep}{tmp_path}{os.pathsep}"
    )
    assert message.endswith(
        ". Fix: put the folder of its module on PYTHONPATH (or start agl-trainer in it); its imports must be "
        "installed in that environment"
    )


@pytest.mark.server
def test_an_agent_class_missing_from_its_module_is_named_with_the_error(tmp_path: Path) -> None:
    env = controller_env("", [SCRIPTED_AGENTS], base={"PATH": os.environ["PATH"]}, cwd=tmp_path)
    with pytest.raises(
        AgentImportError, match=r"AttributeError: module 'agl_scripted_agents' has no attribute 'Nope'"
    ):
        check_agent_class(server_python(), "agl_scripted_agents.Nope", env, tmp_path)
    check_agent_class(server_python(), SCRIPTED_AGENT_CLASS, env, tmp_path)


@pytest.mark.server
@pytest.mark.timeout(180)
@pytest.mark.slow
def test_no_process_agl_starts_has_the_server_key_on_its_command_line(tmp_path: Path) -> None:
    config = scripted_config(rollout_timeout_seconds=60)
    with (
        start_agl_server(server_python(), tmp_path / "server") as server,
        start_controller(
            server_python(), server, tmp_path / "ctl", maximum_size=2, python_path=[SCRIPTED_AGENTS]
        ),
        AglClient(server.url, server.key) as client,
    ):
        scan = KeyScan(server.key)
        scanner = threading.Thread(target=scan.until_every_kind_seen)
        scanner.start()
        SyncRolloutManager(client, config).enqueue_and_wait_until_completed(
            [{"do": "hang", "seconds": 3}, {"do": "reward", "x": 1}], is_train=True
        )
        scanner.join()
    assert scan.with_key_in_argv == []
    assert scan.holders >= {
        "agentlightning.server",
        "agentlightning.controller",
        "_run_local_reconciler_worker",
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AglServer]:
    with start_agl_server(server_python(), tmp_path_factory.mktemp("agl-server")) as running:
        yield running


@pytest.fixture(scope="module")
def controller(server: AglServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AglController]:
    workdir = tmp_path_factory.mktemp("agl-controller")
    with start_controller(
        server_python(), server, workdir, maximum_size=8, python_path=[SCRIPTED_AGENTS]
    ) as running:
        yield running


@pytest.mark.server
@pytest.mark.timeout(180)
@pytest.mark.slow
def test_every_way_a_controller_run_agent_ends_is_returned_once_with_its_reason(
    server: AglServer, controller: AglController
) -> None:
    rows: list[dict[str, Any]] = [
        {"do": "reward", "x": 0.5},
        {"do": "crash"},
        {"do": "exit3"},
        {"do": "silent"},
        {"do": "hang", "seconds": 60},
    ]
    config = scripted_config(rollout_timeout_seconds=8)
    with AglClient(server.url, server.key) as client:
        result = SyncRolloutManager(client, config).enqueue_and_wait_until_completed(rows, is_train=True)
        left = client.list_rollouts(list(RolloutState))
    by_action = {rollout.input["do"]: rollout for rollout in result.completed}
    assert len(result.completed) == len(rows) == len(by_action)
    ended = {
        action: (rollout.rollout_state, rollout.final_reward, rollout.error_message)
        for action, rollout in by_action.items()
        if action != "hang"
    }
    assert ended == {
        "reward": (RolloutState.SUCCEEDED, 0.5, None),
        "crash": (RolloutState.FAILED, None, "subprocess exited with code 1"),
        "exit3": (RolloutState.FAILED, None, "subprocess exited with code 3"),
        # The controller never checks for a reward: the trainer fills it in (reward_fillna_value).
        "silent": (RolloutState.SUCCEEDED, None, None),
    }
    hung = by_action["hang"]
    # Whichever timeout fires first fails it: the trainer's counts from the enqueue, the controller's
    # (SIGKILL, "local subprocess timed out") from the spawn, a tick or more later.
    assert hung.rollout_state == RolloutState.FAILED
    assert hung.timed_out or hung.error_message == "local subprocess timed out"
    assert result.metrics["training/n_rollouts_succeeded"] == 2
    metrics = result.metrics
    assert metrics["training/n_rollouts_failed"] + metrics["training/n_rollouts_timed_out"] == 3
    assert left == [], "every rollout is deleted once returned"


@pytest.mark.server
@pytest.mark.timeout(180)
@pytest.mark.slow
def test_a_controller_killed_mid_wait_and_restarted_leaves_every_rollout_accounted_for_once(
    tmp_path: Path,
) -> None:
    rows: list[dict[str, Any]] = [
        {"do": "hang", "seconds": 5},
        {"do": "hang", "seconds": 5},
        {"do": "reward", "x": 1},
    ]
    config = scripted_config(rollout_timeout_seconds=120)
    with (
        start_agl_server(server_python(), tmp_path / "server") as server,
        AglClient(server.url, server.key) as client,
    ):
        first = start_controller(
            server_python(), server, tmp_path / "first", maximum_size=2, python_path=[SCRIPTED_AGENTS]
        )
        killer = threading.Thread(target=_kill_when_running(client, first, n_running=2))
        killer.start()
        second: list[AglController] = []
        wait_returned = threading.Event()

        def restart_after_kill() -> None:
            killer.join()
            second.append(
                start_controller(
                    server_python(),
                    server,
                    tmp_path / "second",
                    maximum_size=2,
                    python_path=[SCRIPTED_AGENTS],
                )
            )
            # A child started here gets SIGTERM when this thread ends (PR_SET_PDEATHSIG): keep it
            # alive until the wait is over, or the new controller shuts down under the agents.
            wait_returned.wait(timeout=170)

        restarter = threading.Thread(target=restart_after_kill)
        restarter.start()
        try:
            result = SyncRolloutManager(client, config).enqueue_and_wait_until_completed(rows, is_train=True)
        finally:
            wait_returned.set()
            restarter.join()
            first.stop()
            for controller in second:
                controller.stop()
    outcomes = sorted((r.input["do"], r.rollout_state, r.error_message) for r in result.completed)
    # The new controller fails what the killed one was running (its orphans cannot be adopted) and
    # runs what was still queued.
    assert outcomes == [
        ("hang", RolloutState.FAILED, "local subprocess is not running"),
        ("hang", RolloutState.FAILED, "local subprocess is not running"),
        ("reward", RolloutState.SUCCEEDED, None),
    ]
    assert len({r.rollout_id for r in result.completed}) == 3


def _kill_when_running(client: AglClient, controller: AglController, n_running: int) -> Callable[[], None]:
    """SIGKILL the controller (not its agents, which run in sessions of their own) once it runs ``n_running``."""

    def run() -> None:
        deadline = time.monotonic() + 60
        while len(client.list_rollouts([RolloutState.RUNNING])) < n_running:
            assert time.monotonic() < deadline, f"the controller did not start {n_running} agents within 60 s"
            time.sleep(0.05)
        pid = controller.process.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        controller.process.wait_exit(10)

    return run


@pytest.mark.server
@pytest.mark.timeout(180)
@pytest.mark.slow
def test_the_agents_of_a_controller_killed_outright_are_killed_when_it_is_restarted(tmp_path: Path) -> None:
    config = scripted_config(rollout_timeout_seconds=120)
    with (
        start_agl_server(server_python(), tmp_path / "server") as server,
        AglClient(server.url, server.key) as client,
        start_controller(
            server_python(), server, tmp_path / "ctl", maximum_size=2, python_path=[SCRIPTED_AGENTS]
        ) as controller,
    ):
        client.create_rollouts(
            [
                RolloutCreate(
                    input={"do": "hang", "seconds": 120},
                    config=config.rollout_config(),
                    rollout_id=uuid.uuid4().hex,
                )
                for _ in range(2)
            ]
        )
        _kill_when_running(client, controller, n_running=2)()
        agents = _agents_of(server.url)
        assert len(agents) == 2
        controller.restart()
        deadline = time.monotonic() + 10
        while (alive := [pid for pid in agents if _alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert alive == [], "the dead controller's agents still run"


def _agents_of(server_url: str) -> list[int]:
    """The pids of the agents running rollouts of the agl-server at ``server_url`` (their event URL names it)."""
    tag = f"AGL_EVENT_URL={server_url}/".encode()
    pids: list[int] = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and any(
                v.startswith(tag) for v in (entry / "environ").read_bytes().split(b"\0")
            ):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not reaped by whoever adopted it, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
