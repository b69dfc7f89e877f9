"""Plain-JSON conversion of batch values, without importing numpy or torch.

Arrays and tensors are recognised by duck typing (``tolist``/``item``), so this module
works whether or not numpy or torch are installed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

_SCALARS = (str, int, float, bool, type(None))


def to_native(value: Any) -> Any:
    """``value`` as plain JSON-able Python: numpy arrays and tensors become lists, their scalars
    Python numbers, mappings dicts (keys as ``str``), tuples and sets lists. Returns a new object,
    never the input itself for containers, so callers may mutate the result freely.
    """
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, Mapping):
        return {str(k): to_native(v) for k, v in value.items()}  # pyright: ignore[reportUnknownVariableType]
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
        return [to_native(v) for v in items]
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return to_native(tolist())
    item = getattr(value, "item", None)
    if callable(item):
        return to_native(item())
    raise TypeError(
        f"cannot convert {type(value).__module__}.{type(value).__qualname__} to JSON for a rollout input; "
        "give plain Python values, numpy arrays or torch tensors"
    )


def as_reward(value: Any) -> float | None:
    """A reward value as a finite float, or ``None`` for anything else (bools included)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    reward = float(value)
    return reward if math.isfinite(reward) else None


__all__ = ("as_reward", "to_native")
