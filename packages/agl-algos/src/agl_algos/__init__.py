"""agl-algos."""

from importlib.metadata import version as _version

__version__ = _version("agl-algos")

__all__ = ("__version__",)
