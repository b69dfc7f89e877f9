"""verl's own token-level policy losses with one rollout, one vote.

With advantages divided per rollout by :func:`agl_algos.normalize_advantages_by_rollout`, a loss whose
tokens are simply summed is the mean over rollouts of each rollout's token mean, however many rows a
rollout spans. verl's token-level losses (``vanilla``, ``cispo``, ...) aggregate their token losses with
the actor's ``loss_agg_mode``, which also aggregates the entropy and KL terms; so rather than change
that setting, each of them is registered once more as ``rollout_summed:<name>``, the same loss called
with ``loss_agg_mode="token-sum"`` (verl 0.9+). Sequence-level losses (``gspo``, ``geo_mean``, ``sapo``)
take a ratio per row and are not wrapped: ``gspo_per_rollout`` is the per-rollout GSPO.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ("ROLLOUT_SUMMED_PREFIX", "VERL_TOKEN_LEVEL_LOSSES", "rollout_summed_name", "token_summed")

ROLLOUT_SUMMED_PREFIX = "rollout_summed:"
"""Registry names of the wrapped verl losses: ``rollout_summed:vanilla`` and so on."""

VERL_TOKEN_LEVEL_LOSSES: tuple[str, ...] = (
    "vanilla",
    "cispo",
    "dppo_tv",
    "dppo_kl",
    "gpg",
    "clip_cov",
    "kl_cov",
    "dro",
)
"""verl 0.9's policy losses whose token losses depend only on their own token and reach ``agg_loss``
with the caller's ``loss_agg_mode``: summing them is exact under per-rollout advantages."""


def rollout_summed_name(loss_mode: str) -> str:
    """The registry name of ``loss_mode`` summed over tokens, e.g. ``rollout_summed:vanilla``."""
    return f"{ROLLOUT_SUMMED_PREFIX}{loss_mode}"


@functools.cache
def token_summed(
    loss_fn: Callable[..., tuple[Any, dict[str, Any]]],
) -> Callable[..., tuple[Any, dict[str, Any]]]:
    """``loss_fn`` called with ``loss_agg_mode="token-sum"`` whatever the actor's mode; one wrapper per
    function, so registering it again is a no-op."""

    @functools.wraps(loss_fn)
    def summed(**kwargs: Any) -> tuple[Any, dict[str, Any]]:
        return loss_fn(**{**kwargs, "loss_agg_mode": "token-sum"})

    summed.__qualname__ = f"token_summed({loss_fn.__qualname__})"
    return summed
