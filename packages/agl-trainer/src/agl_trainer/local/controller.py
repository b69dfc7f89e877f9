"""Start the real ``agl-controller`` (``runner_type=local``) as a child, for ``runner=controller``.

The controller polls agl-server for queuing rollouts and runs each one's
``config.local.agent_class`` in its own Python process, with the controller's interpreter: the
agent's module must be importable there. :func:`agent_import_path` makes agl-trainer's own toy
agents importable from the agl-server tool environment without installing agl-trainer into it.

The controller gives no readiness signal (a wrong key or URL only logs an error every tick), so
:func:`start_controller` returns once the process runs; rollouts queue until its first tick.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import agl_trainer
from agl_trainer.local.errors import ProcessStartError
from agl_trainer.local.processes import ChildProcess
from agl_trainer.local.services import AglServer

DEFAULT_POLL_INTERVAL_SECONDS = 0.2
"""The controller's tick (its default is 10 s): a rollout turns terminal only on the tick after its
agent exits, so every second here is a second added to each step."""
_STARTED_CHECK_SECONDS = 1.0


def agl_controller_argv(
    python: Path, *, server_url: str, key: str, maximum_size: int, poll_interval: float, workdir: Path
) -> list[str]:
    """``python -m agentlightning.controller`` in local mode, with Hydra's outputs and log setup off."""
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
        f"agl_server.key={key}",
        f"local_runner.maximum_size={maximum_size}",
        f"local_runner.poll_interval={poll_interval}",
        f"hydra.run.dir={workdir}",
        "hydra.output_subdir=null",
        "hydra/job_logging=disabled",
    ]


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


@dataclass
class AglController:
    """A running agl-controller child."""

    process: ChildProcess

    def stop(self) -> None:
        """SIGTERM: it fails its running rollouts ("local controller shutdown") and exits in about 2 s."""
        self.process.stop(grace=10.0)

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

    ``python_path`` goes first on the agents' ``PYTHONPATH`` (where their ``agent_class`` modules
    are). Raises :class:`ProcessStartError` when the process exits at once (a bad override).
    """
    argv = agl_controller_argv(
        python,
        server_url=server.url,
        key=server.key,
        maximum_size=maximum_size,
        poll_interval=poll_interval,
        workdir=workdir,
    )
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env["PYTHONPATH"] = os.pathsep.join(str(path) for path in python_path)
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
    return AglController(child)
