"""agl-trainer: verl's RayPPOTrainer assembled with agl's rollout, adapter and algorithms.

Importing the package itself needs nothing installed: agl-controller's workers import the toy
agents (:mod:`agl_trainer.local.toy_agents`) from the package folder, in an environment that has
neither verl nor agl-trainer's distribution metadata.
"""

import os
from typing import TYPE_CHECKING

# Started by `uv run agl-trainer`, Ray (>= 2.47) would run every worker with `uv run` in a copy
# of the working directory: a fresh venv per session, resolved from PyPI (the CUDA build of torch,
# gigabytes) unless pip's find-links happen to be set. The workers must run in this venv instead.
# Ray reads the switch once, when it is imported, so it is set before anything here imports Ray;
# RAY_ENABLE_UV_RUN_RUNTIME_ENV=1 in the environment keeps Ray's behaviour.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

if TYPE_CHECKING:
    from agl_trainer.assembly import build_trainer, compose_config, run_ppo
    from agl_trainer.trainer import AglRayPPOTrainer

    __version__: str


def __getattr__(name: str) -> object:
    if name == "__version__":
        from importlib.metadata import version

        return version("agl-trainer")
    # The trainer pulls verl and ray (seconds to import); load them only when asked for.
    if name in ("compose_config", "run_ppo", "build_trainer"):
        from agl_trainer import assembly

        return getattr(assembly, name)
    if name == "AglRayPPOTrainer":
        from agl_trainer.trainer import AglRayPPOTrainer

        return AglRayPPOTrainer
    raise AttributeError(f"module 'agl_trainer' has no attribute {name!r}")


__all__ = ("AglRayPPOTrainer", "__version__", "build_trainer", "compose_config", "run_ppo")
