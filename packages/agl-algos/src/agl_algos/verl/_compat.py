"""The one place that knows how verl releases differ. Everything verl-version-specific lives here.

Facts per supported release (0.7.1, 0.8.x, 0.9.x):
- policy losses are registered with ``verl.trainer.ppo.core_algos.register_policy_loss(name)`` into
  ``POLICY_LOSS_REGISTRY`` and looked up with ``get_policy_loss_fn``; workers call them with keywords
  ``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)``
  and expect ``(loss, metrics)``. Older releases (0.5.x) passed ``rollout_log_probs`` and expected a
  4-tuple; the signature check below refuses them with the supported range.
- the actor config's ``global_batch_info`` is filled by the engine workers (0.7.1+) and left empty by
  0.7.1's legacy ``dp_actor``; :class:`agl_algos.PolicyLossConfig` reads both.
- ``compute_advantage`` lives in ``verl.trainer.ppo.ray_trainer`` in all of them.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
import warnings
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

__all__ = (
    "SUPPORTED_VERL",
    "compute_advantage_fn",
    "register_policy_loss",
    "verl_version",
    "warn_if_unsupported",
)

_LOG = logging.getLogger(__name__)

SUPPORTED_VERL = ">=0.7.1,<0.10"
"""0.7.1: first release the reference supports (engine workers with global_batch_info);
<0.10: the newest release line checked here is 0.9.x."""

_MIN = (0, 7, 1)
_MAX_EXCLUSIVE = (0, 10)
_POLICY_LOSS_PARAMS = (
    "old_log_prob",
    "log_prob",
    "advantages",
    "response_mask",
    "loss_agg_mode",
    "config",
    "rollout_is_weights",
)
_INSTALL_HINT = "pip install 'agl-algos[verl]'"


def _core_algos() -> Any:
    try:
        return importlib.import_module("verl.trainer.ppo.core_algos")
    except ImportError as error:
        raise ImportError(f"agl_algos.verl needs verl {SUPPORTED_VERL}: {_INSTALL_HINT}") from error


def verl_version() -> tuple[int, ...]:
    """The installed verl release as a tuple of ints, e.g. (0, 9, 1); pre-release tags are ignored."""
    try:
        text = version("verl")
    except PackageNotFoundError as error:
        raise ImportError(f"verl is not installed: {_INSTALL_HINT}") from error
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])


def warn_if_unsupported() -> None:
    """Warn (a RuntimeWarning) when the installed verl is outside :data:`SUPPORTED_VERL`."""
    installed = verl_version()
    if not (_MIN <= installed < _MAX_EXCLUSIVE):
        warnings.warn(
            f"verl {'.'.join(map(str, installed))} is outside the range agl-algos supports ({SUPPORTED_VERL}); "
            "the per_rollout_mean loss is registered but untested there",
            RuntimeWarning,
            stacklevel=2,
        )


def _check_policy_loss_signature(core_algos: Any) -> None:
    vanilla = core_algos.get_policy_loss_fn("vanilla")
    params = tuple(inspect.signature(vanilla).parameters)
    if params != _POLICY_LOSS_PARAMS:
        raise RuntimeError(
            f"verl {'.'.join(map(str, verl_version()))} calls policy losses with {params}, agl-algos supports "
            f"{_POLICY_LOSS_PARAMS} (verl {SUPPORTED_VERL}); install a supported verl"
        )


def register_policy_loss(name: str, loss_fn: Callable[..., Any]) -> None:
    """Put ``loss_fn`` into verl's policy-loss registry under ``name``; a no-op if it is there already.

    A different function under the same name (e.g. Agent Lightning's) is replaced with a warning.
    """
    core_algos = _core_algos()
    registry: dict[str, Any] = core_algos.POLICY_LOSS_REGISTRY
    current = registry.get(name)
    if current is loss_fn:
        return
    _check_policy_loss_signature(core_algos)
    if current is not None:
        _LOG.warning(
            "replacing policy loss %r (%s.%s) with %s.%s",
            name,
            getattr(current, "__module__", "?"),
            getattr(current, "__qualname__", "?"),
            loss_fn.__module__,
            loss_fn.__qualname__,
        )
    core_algos.register_policy_loss(name)(loss_fn)


def compute_advantage_fn() -> Callable[..., Any]:
    """verl's ``compute_advantage(data, adv_estimator, gamma, lam, num_repeat, norm_adv_by_std_in_grpo, config)``."""
    return importlib.import_module("verl.trainer.ppo.ray_trainer").compute_advantage
