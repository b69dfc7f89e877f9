"""agl-adapter."""

from importlib.metadata import version as _version

__version__ = _version("agl-adapter")

__all__ = ("__version__",)
