"""agl-trainer: verl's RayPPOTrainer assembled with agl's rollout, adapter and algorithms.

Importing the package itself needs nothing installed: agl-controller's workers import the toy
agents (:mod:`agl_trainer.local.toy_agents`) from the package folder, in an environment that has
neither verl nor agl-trainer's distribution metadata.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agl_trainer.entrypoint import build_trainer, compose_config, run_ppo
    from agl_trainer.trainer import AglRayPPOTrainer

    __version__: str


def __getattr__(name: str) -> object:
    if name == "__version__":
        from importlib.metadata import version

        return version("agl-trainer")
    # The trainer pulls verl and ray (seconds to import); load them only when asked for.
    if name in ("compose_config", "run_ppo", "build_trainer"):
        from agl_trainer import entrypoint

        return getattr(entrypoint, name)
    if name == "AglRayPPOTrainer":
        from agl_trainer.trainer import AglRayPPOTrainer

        return AglRayPPOTrainer
    raise AttributeError(f"module 'agl_trainer' has no attribute {name!r}")


__all__ = ("AglRayPPOTrainer", "__version__", "build_trainer", "compose_config", "run_ppo")
