"""The real ``agl-trainer`` command started as a user starts it, for tests that watch it run.

It runs in a fresh cache folder that shares the tool environments and the tiny model of the usual
one, in a session of its own (like a terminal's job) with SIGINT ignored (like a script's
background job, whatever the test process was handed), with its stdout and stderr in files.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from agl_testing.requirements import missing_requirement
from agl_trainer.local import agl_server_spec, cache_dir, existing_tool_env, vllm_cpu_spec
from agl_trainer.local.demo import build_embedded_model

AGL_TRAINER = Path(sys.executable).with_name("agl-trainer")


@dataclass
class Run:
    """One ``agl-trainer`` process, its cache folder and its output files."""

    process: subprocess.Popen[bytes]
    cache: Path
    stdout: Path
    stderr: Path

    @property
    def run_dir(self) -> Path:
        (folder,) = (self.cache / "runs").iterdir()
        return folder

    def steps_logged(self) -> int:
        metrics = self.cache / "runs"
        files = list(metrics.glob("*/metrics.jsonl")) if metrics.is_dir() else []
        return sum(1 for line in files[0].read_text().splitlines() if line.strip()) if files else 0

    def wait_steps(self, n: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while self.steps_logged() < n:
            assert self.process.poll() is None, (
                f"agl-trainer exited early:\n{self.stderr.read_text()[-3000:]}"
            )
            assert time.monotonic() < deadline, f"no {n} steps within {timeout} s"
            time.sleep(0.2)

    def wait(self, timeout: float = 600) -> int:
        return self.process.wait(timeout)

    def said(self) -> list[str]:
        """What agl-trainer itself wrote on stderr: its ``agl-trainer: ...`` lines."""
        return [line for line in self.stderr.read_text().splitlines() if line.startswith("agl-trainer: ")]


def _as_a_script_starts_it_in_the_background() -> None:
    """SIGINT ignored, as a shell without job control hands it to ``agl-trainer &`` (CI runners and
    scripts do): the command must hear Ctrl-C and its supervisor's interrupt all the same."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def start_trainer(
    tmp_path: Path,
    args: tuple[str, ...],
    python_path: Path | None = None,
    models: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Run:
    """``agl-trainer *args`` started in ``tmp_path`` (see the module docstring); its
    cache's ``models`` folder is ``models`` (default: the usual cache's, with its tiny model);
    ``env`` is added to its environment."""
    server_env, vllm_env = existing_tool_env(agl_server_spec()), existing_tool_env(vllm_cpu_spec())
    if server_env is None or vllm_env is None:
        missing_requirement(
            "agl-server / vllm-cpu tool environments absent: run scripts/test to provision them"
        )
    cache = tmp_path / "cache"
    cache.mkdir()
    if models is None:
        build_embedded_model()  # the usual cache's tiny model, whichever test of the suite runs first
    (cache / "models").symlink_to(models or cache_dir() / "models", target_is_directory=True)
    environment = {
        **os.environ,
        "AGL_CACHE_DIR": str(cache),
        "AGL_SERVER_PYTHON": str(server_env.python),
        "AGL_VLLM_PYTHON": str(vllm_env.python),
        **(env or {}),
    }
    environment.pop("PYTHONPATH", None)
    if python_path is not None:
        environment["PYTHONPATH"] = str(python_path)
    stdout, stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with stdout.open("wb") as out, stderr.open("wb") as err:
        process = subprocess.Popen(
            [str(AGL_TRAINER), *args],
            cwd=tmp_path,
            env=environment,
            stdout=out,
            stderr=err,
            start_new_session=True,
            preexec_fn=_as_a_script_starts_it_in_the_background,
        )
    return Run(process, cache, stdout, stderr)


__all__ = ("AGL_TRAINER", "Run", "start_trainer")
