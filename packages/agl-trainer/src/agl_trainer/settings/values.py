"""Typed reads of single config values; each error names the key, the value and what is allowed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

_C = TypeVar("_C")


def select(config: DictConfig, key: str, default: Any = None) -> Any:
    """The value at the dotted ``key``; ``default`` when it is absent or null."""
    value = OmegaConf.select(config, key, default=None)
    return default if value is None else value


def select_or_null(config: DictConfig, key: str, default: Any) -> Any:
    """The value at the dotted ``key``; ``default`` when it is absent, None when it is null."""
    return OmegaConf.select(config, key, default=default)


def one_of(key: str, value: Any, choices: tuple[_C, ...]) -> _C:
    """``value`` as the matching element of ``choices`` (a Literal's values), else ``ValueError``."""
    for choice in choices:
        if value == choice:
            return choice
    raise ValueError(f"{key}={value!r}; supported: {list(choices)}")


def flag(key: str, value: Any) -> bool:
    """``value`` as a bool; anything else (a string, a number) raises ``ValueError``."""
    if not isinstance(value, bool):
        raise ValueError(f"{key}={value!r}; set it to true or false")
    return value


def integer(key: str, value: Any, *, minimum: int | None = None) -> int:
    """``value`` as an int (>= ``minimum`` when given)."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if not is_int or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"{key} must be an int{bound}, got {value!r}")
    return value


def optional_integer(key: str, value: Any, *, minimum: int) -> int | None:
    """``value`` as None (null) or an int >= ``minimum``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key} must be null or an int >= {minimum}, got {value!r}")
    return value


def positive(key: str, value: Any) -> float:
    """``value`` as a float > 0."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{key} must be > 0, got {value!r}")
    return float(value)


def optional_positive(key: str, value: Any) -> float | None:
    """``value`` as None (null) or a float > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        shown = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
        raise ValueError(f"{key} must be null or > 0, got {shown!r}")
    return float(value)


def number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} must be a number, got {value!r}")
    return float(value)


def text(value: Any) -> str | None:
    """``value`` as a string; None for null or ''."""
    return None if value is None or value == "" else str(value)


def section(value: Any) -> dict[str, Any]:
    """A config section (or null) as a plain dict."""
    if value is None:
        return {}
    container: Any = OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value
    if not isinstance(container, Mapping):
        raise ValueError(f"expected a mapping, got {value!r}")
    return {str(key): item for key, item in container.items()}  # pyright: ignore[reportUnknownVariableType]


def leaf_keys(config: DictConfig) -> list[str]:
    """Every key of ``config`` that holds a value, dotted, in the config's order (no interpolation is resolved)."""

    def walk(node: Any, prefix: str) -> list[str]:
        if isinstance(node, Mapping):
            return [leaf for key, value in node.items() for leaf in walk(value, f"{prefix}{key}.")]
        return [prefix.rstrip(".")]

    return walk(OmegaConf.to_container(config, resolve=False), "")


__all__ = (
    "leaf_keys",
    "flag",
    "integer",
    "number",
    "one_of",
    "optional_integer",
    "optional_positive",
    "positive",
    "section",
    "select",
    "select_or_null",
    "text",
)
