"""Start the real ``agl-controller`` (``runner_type=local``) as a child, for ``runner=controller``.

The controller polls agl-server for queuing rollouts and runs each one's
``config.local.agent_class`` in its own Python process, with the controller's interpreter: the
agent's module must be importable there. :func:`agent_import_path` makes agl-trainer's own toy
agents importable from the agl-server tool environment without installing agl-trainer into it;
the user's ``PYTHONPATH`` and working directory follow it (:func:`agents_python_path`), and
:func:`check_agent_class` imports an ``agent_class`` as the workers will, before any rollout.

Each agent runs in a session of its own, outside the controller's process group, so a controller
killed outright (SIGKILL) leaves them running. Every controller's environment, which its agents
inherit, carries an id of its own (:data:`AGENTS_TAG_ENV`): stopping or restarting it kills the
process group of every process that still carries it (:func:`kill_tagged_groups`).

The controller gives no readiness signal (a wrong key or URL only logs an error every tick), so
:func:`start_controller` returns once the process runs; rollouts queue until its first tick.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import agl_trainer
from agl_trainer.local.errors import AgentImportError, ProcessStartError
from agl_trainer.local.processes import ChildProcess
from agl_trainer.local.services import KEY_FROM_ENV, AglServer, key_env

DEFAULT_POLL_INTERVAL_SECONDS = 0.2
"""The controller's tick (its default is 10 s): a rollout turns terminal only on the tick after its
agent exits, so every second here is a second added to each step."""
_STARTED_CHECK_SECONDS = 1.0
AGENTS_TAG_ENV = "AGL_TRAINER_CONTROLLER_ID"
"""Set to a fresh id in each controller's environment; its agents inherit it."""


def agl_controller_argv(
    python: Path, *, server_url: str, maximum_size: int, poll_interval: float, workdir: Path
) -> list[str]:
    """``python -m agentlightning.controller`` in local mode, with Hydra's outputs and log setup off.

    The key is read from :data:`~agl_trainer.local.services.KEY_ENV` (:func:`controller_env`).
    """
    if maximum_size < 1:
        raise ValueError(f"maximum_size={maximum_size} must be >= 1 (agents the controller runs at once)")
    if not poll_interval > 0:
        raise ValueError(f"poll_interval={poll_interval} must be > 0 seconds")
    return [
        str(python),
        "-m",
        "agentlightning.controller",
        "runner_type=local",
        f"agl_server.url={server_url}",
        f"agl_server.key={KEY_FROM_ENV}",
        f"local_runner.maximum_size={maximum_size}",
        f"local_runner.poll_interval={poll_interval}",
        f"hydra.run.dir={workdir}",
        "hydra.output_subdir=null",
        "hydra/job_logging=disabled",
    ]


def agents_python_path(python_path: Sequence[Path], base: Mapping[str, str], cwd: Path) -> list[str]:
    """The agents' ``PYTHONPATH``: ``python_path``, then the user's ``PYTHONPATH`` (from ``base``), then
    ``cwd`` (where agl-trainer was started), each absolute: the controller runs in the run folder, so
    a relative entry would point elsewhere."""
    user = [entry or "." for entry in base.get("PYTHONPATH", "").split(os.pathsep) if base.get("PYTHONPATH")]
    entries = [*map(str, python_path), *user, str(cwd)]
    absolute = [str((cwd / entry).absolute()) if not os.path.isabs(entry) else entry for entry in entries]
    return list(dict.fromkeys(absolute))


def controller_env(
    key: str, python_path: Sequence[Path] = (), base: Mapping[str, str] | None = None, cwd: Path | None = None
) -> dict[str, str]:
    """agl-controller's environment, which its agents inherit: ``base`` (default: this process's) with
    the server key and :func:`agents_python_path` as ``PYTHONPATH``."""
    env = key_env(key, base)
    env["PYTHONPATH"] = os.pathsep.join(agents_python_path(python_path, env, cwd or Path.cwd()))
    return env


_IMPORT_PROBE = """
import importlib, json, os, sys
path = sys.argv[1]
module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
try:
    loaded = getattr(importlib.import_module(module), name)
    if not isinstance(loaded, type):
        raise TypeError(f"{path} is not a class")
except Exception as error:
    print(json.dumps({"error": f"{type(error).__name__}: {error}", "path": [p or os.getcwd() for p in sys.path]}))
    sys.exit(1)
"""


def check_agent_class(python: Path, agent_class: str, env: Mapping[str, str], workdir: Path) -> None:
    """Import ``agent_class`` (``mod:Class`` or ``mod.Class``) as the controller's workers do: with
    ``python``, ``env`` and ``workdir`` as the working directory. Raises :class:`AgentImportError`,
    one line naming the class, the error and the paths searched."""
    workdir.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [str(python), "-c", _IMPORT_PROBE, agent_class],
        env=dict(env),
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode == 0:
        return
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
        error, searched = str(found["error"]), [str(entry) for entry in found["path"]]
    except (IndexError, ValueError, KeyError):
        error, searched = f"exit code {done.returncode}: {done.stderr.strip()[-500:]}", []
    raise AgentImportError(
        f"agentlightning.local.agent_class={agent_class} cannot be imported by agl-controller's Python "
        f"({python}): {error}; paths searched: {os.pathsep.join(searched)}. Fix: put the folder of its module "
        "on PYTHONPATH (or start agl-trainer in it); its imports must be installed in that environment"
    )


def agent_import_path(workdir: Path) -> Path:
    """A folder holding only a link to this ``agl_trainer`` package: on ``PYTHONPATH`` it makes
    ``agl_trainer.local.toy_agents`` importable without the trainer's other packages."""
    folder = workdir / "agent-path"
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "agl_trainer"
    package = Path(agl_trainer.__file__).resolve().parent
    if link.is_symlink() and link.resolve() != package:
        link.unlink()
    if not link.is_symlink():
        link.symlink_to(package, target_is_directory=True)
    return folder


def kill_tagged_groups(name: str, value: str) -> int:
    """SIGKILL the process group of every process whose environment holds ``name=value`` (read from
    ``/proc``; none elsewhere), never this process's own group. Returns how many processes had it."""
    proc = Path("/proc")
    if not proc.is_dir():
        return 0
    tag, own_group, n_tagged = f"{name}={value}".encode(), os.getpgrp(), 0
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if tag not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            pid = int(entry.name)
            group = os.getpgid(pid)
            if group == own_group:
                os.kill(pid, signal.SIGKILL)
            else:
                os.killpg(group, signal.SIGKILL)
        except (OSError, ProcessLookupError):  # gone meanwhile, or not ours to read
            continue
        n_tagged += 1
    return n_tagged


@dataclass
class AglController:
    """A running agl-controller child; :meth:`restart` replaces a dead one with the same command.

    ``agents_tag``: the value of :data:`AGENTS_TAG_ENV` in its environment and its agents'.
    """

    process: ChildProcess
    agents_tag: str

    def restart(self) -> None:
        """Start a new controller process, as the dead one was started (same log file, appended),
        once the dead one's agents are killed.

        The new controller fails the rollouts the old one left running ("local subprocess is not
        running") on its first tick, and runs the queued ones.
        """
        old = self.process
        old.stop()
        kill_tagged_groups(AGENTS_TAG_ENV, self.agents_tag)
        self.process = ChildProcess(
            old.name, old.argv, cwd=old.cwd, log_path=old.log_path, env=old.env
        ).start()

    def stop(self) -> None:
        """SIGTERM: it fails its running rollouts ("local controller shutdown") and exits in about 2 s;
        then the agents it left (it was killed, or did not stop within 10 s) are killed."""
        self.process.stop(grace=10.0)
        kill_tagged_groups(AGENTS_TAG_ENV, self.agents_tag)

    def __enter__(self) -> AglController:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_controller(
    python: Path,
    server: AglServer,
    workdir: Path,
    *,
    maximum_size: int,
    poll_interval: float = DEFAULT_POLL_INTERVAL_SECONDS,
    python_path: Sequence[Path] = (),
) -> AglController:
    """Start agl-controller for ``server`` in ``workdir`` (its log: ``agl-controller.log``).

    The agents' ``PYTHONPATH`` is :func:`agents_python_path`: ``python_path`` (where their
    ``agent_class`` modules are), the user's ``PYTHONPATH``, the current directory. Raises
    :class:`ProcessStartError` when the process exits at once (a bad override).
    """
    argv = agl_controller_argv(
        python,
        server_url=server.url,
        maximum_size=maximum_size,
        poll_interval=poll_interval,
        workdir=workdir,
    )
    agents_tag = uuid.uuid4().hex
    env = {**controller_env(server.key, python_path), AGENTS_TAG_ENV: agents_tag}
    child = ChildProcess(
        "agl-controller", argv, cwd=workdir, log_path=workdir / "agl-controller.log", env=env
    )
    child.start()
    try:
        code = child.wait_exit(_STARTED_CHECK_SECONDS)
    except BaseException:
        child.stop()
        raise
    if code is not None:
        raise ProcessStartError(
            f"agl-controller exited with code {code} at start; last lines of {child.log_path}:\n{child.log_tail()}"
        )
    return AglController(child, agents_tag)
