"""Frozen parameters of the per-rollout-mean PPO loss, read from verl's actor config or a mapping."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ("PolicyLossConfig",)

_MISSING = object()


def _read(config: object, key: str, default: Any) -> Any:
    """Read ``key`` from a Mapping, an object with ``.get`` (OmegaConf, verl configs) or attributes."""
    if isinstance(config, Mapping):
        return config.get(key, default)
    getter = getattr(config, "get", None)
    if callable(getter):
        return getter(key, default)
    return getattr(config, key, default)


def _finite(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {value!r}; set actor.{key} to e.g. 0.2")
    return float(value)


@dataclass(frozen=True, slots=True)
class PolicyLossConfig:
    """Clip parameters of the PPO objective and the data-parallel size the loss is scaled by.

    ``clip_ratio_low`` / ``clip_ratio_high`` fall back to ``clip_ratio`` when None (verl's convention);
    ``clip_ratio_c`` is the dual-clip bound for negative advantages (Ye et al. 2019, arXiv:1912.09729).
    ``dp_size`` compensates the gradient averaging of FSDP/DDP over data-parallel ranks.
    """

    clip_ratio: float | None = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    dp_size: int = 1

    def __post_init__(self) -> None:
        for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, key)
            if value is not None and _finite(key, value) < 0:
                raise ValueError(f"{key} must be >= 0, got {value!r}; PPO clips the ratio to [1-low, 1+high]")
        if self.clip_ratio is None and (self.clip_ratio_low is None or self.clip_ratio_high is None):
            raise ValueError(
                "clip_ratio is None and clip_ratio_low/clip_ratio_high do not both replace it; "
                "set actor.clip_ratio (e.g. 0.2)"
            )
        if _finite("clip_ratio_c", self.clip_ratio_c) <= 1.0:
            raise ValueError(
                f"clip_ratio_c must be greater than 1.0, got {self.clip_ratio_c!r}; "
                "the dual clip bounds the loss of a negative advantage at clip_ratio_c*|A| (verl default 3.0)"
            )
        if type(self.dp_size) is not int or self.dp_size < 1:
            raise ValueError(f"dp_size must be an integer >= 1, got {self.dp_size!r}")

    @property
    def low(self) -> float:
        """The lower clip range ε_low (ratio clipped at 1 - ε_low)."""
        value = self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low
        assert value is not None  # guaranteed by __post_init__
        return value

    @property
    def high(self) -> float:
        """The upper clip range ε_high (ratio clipped at 1 + ε_high)."""
        value = self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high
        assert value is not None  # guaranteed by __post_init__
        return value

    @classmethod
    def from_actor_config(cls, config: object) -> PolicyLossConfig:
        """Build from verl's actor config (``ActorConfig``, OmegaConf) or a plain mapping.

        Reads ``clip_ratio`` (default 0.2), ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``
        (default 3.0) and ``global_batch_info["dp_size"]`` (absent, 0 or None mean 1, as verl's legacy
        workers leave ``global_batch_info`` empty). A ``PolicyLossConfig`` is returned unchanged.
        """
        if isinstance(config, PolicyLossConfig):
            return config
        if config is None:
            raise ValueError(
                "config is None: the per_rollout_mean loss needs the actor config "
                "(verl passes actor_rollout_ref.actor; plain callers pass a PolicyLossConfig)"
            )
        batch_info = _read(config, "global_batch_info", None) or {}
        dp_size = _read(batch_info, "dp_size", 1) or 1
        return cls(
            clip_ratio=_read(config, "clip_ratio", 0.2),
            clip_ratio_low=_read(config, "clip_ratio_low", None),
            clip_ratio_high=_read(config, "clip_ratio_high", None),
            clip_ratio_c=_read(config, "clip_ratio_c", 3.0),
            dp_size=int(dp_size),
        )
