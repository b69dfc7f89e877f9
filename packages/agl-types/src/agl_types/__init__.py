"""agl-types."""

from importlib.metadata import version as _version

__version__ = _version("agl-types")

__all__ = ("__version__",)
