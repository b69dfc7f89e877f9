"""agl-trainer."""

from importlib.metadata import version as _version

__version__ = _version("agl-trainer")

__all__ = ("__version__",)
