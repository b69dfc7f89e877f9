"""Every verl-version-dependent detail of agl-trainer, in one place.

agl-trainer supports verl ``>=0.9,<0.10`` (see ``pyproject.toml`` for why each bound). Outside
that range it still starts, with a warning naming the installed and the supported versions.
"""

import warnings
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed_version
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

__all__ = ("SUPPORTED_VERL", "check_verl_version", "verl_config_dir")

SUPPORTED_VERL = SpecifierSet(">=0.9,<0.10")


def check_verl_version(installed: str | None = None) -> bool:
    """Warn (``RuntimeWarning``) when the installed verl is outside :data:`SUPPORTED_VERL`.

    ``installed`` defaults to the installed distribution's version. Returns whether it is
    supported. Raises ``ImportError`` with the install command when verl is not installed.
    """
    if installed is None:
        try:
            installed = installed_version("verl")
        except PackageNotFoundError as error:
            raise ImportError(
                f"agl-trainer needs verl{SUPPORTED_VERL}, which is not installed; "
                f"install it with: pip install 'verl{SUPPORTED_VERL}'"
            ) from error
    supported = Version(installed) in SUPPORTED_VERL
    if not supported:
        warnings.warn(
            f"verl {installed} is installed, but agl-trainer supports verl{SUPPORTED_VERL}; "
            f"it may fail in verl's trainer plumbing. Install a supported one: pip install 'verl{SUPPORTED_VERL}'",
            RuntimeWarning,
            stacklevel=2,
        )
    return supported


def verl_config_dir() -> Path:
    """The folder of verl's Hydra configs (``ppo_trainer.yaml``); ``verl/trainer/config`` in 0.9."""
    import verl.trainer.config as verl_trainer_config

    return Path(verl_trainer_config.__file__).parent
