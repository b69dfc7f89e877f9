"""agl-rollout."""

from importlib.metadata import version as _version

__version__ = _version("agl-rollout")

__all__ = ("__version__",)
