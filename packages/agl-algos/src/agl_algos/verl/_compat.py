"""The one place that knows how verl releases differ. Everything verl-version-specific lives here.

Read from the wheels of 0.7.1, 0.8.0 and 0.9.1 (``verl/trainer/ppo/core_algos.py`` and its callers):
- all three register policy losses with ``register_policy_loss(name)`` into ``POLICY_LOSS_REGISTRY``
  and look them up with ``get_policy_loss_fn``; every caller (``workers/utils/losses.py``, 0.7.1's
  ``dp_actor`` and ``megatron_actor``, the distillation loss of 0.8+) passes keywords only, the ones
  in :data:`POLICY_LOSS_CALL_KEYWORDS`, and expects ``(loss, metrics)``. The keywords are the same in the three
  lines, so the loss is registered as it is; a release calling with other keywords (0.5.x passed
  ``rollout_log_probs``) is refused with the supported range.
- 0.7.1 still defaults to the legacy ``dp_actor`` (``use_legacy_worker_impl: auto``), which leaves the
  actor config's ``global_batch_info`` empty (dp_size read as 1) and multiplies the loss by the
  micro/mini-batch ratio; 0.8+ have only the engine workers, which fill ``global_batch_info``.
  :class:`agl_algos.PolicyLossConfig` reads both.
- ``agg_loss`` has ``"token-sum"`` in 0.9.x, not in 0.7.1 or 0.8.0.
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
    "POLICY_LOSS_CALL_KEYWORDS",
    "SUPPORTED_VERL",
    "compute_advantage_fn",
    "register_policy_loss",
    "verl_policy_losses",
    "verl_version",
    "warn_if_unsupported",
)

_LOG = logging.getLogger(__name__)

SUPPORTED_VERL = ">=0.7.1,<0.10"
"""0.7.1: first release the reference supports (engine workers with global_batch_info);
<0.10: the newest release line checked here is 0.9.x."""

_MIN = (0, 7, 1)
_MAX_EXCLUSIVE = (0, 10)
_KEYWORDS = (
    "old_log_prob",
    "log_prob",
    "advantages",
    "response_mask",
    "loss_agg_mode",
    "config",
    "rollout_is_weights",
)
POLICY_LOSS_CALL_KEYWORDS: dict[tuple[int, ...], tuple[str, ...]] = {
    (0, 7): _KEYWORDS,
    (0, 8): _KEYWORDS,
    (0, 9): _KEYWORDS,
}
"""The keywords each supported release line calls a policy loss with (its vanilla loss's parameters)."""
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
            "agl-algos' policy losses are registered but untested there",
            RuntimeWarning,
            stacklevel=2,
        )


def _check_policy_loss_signature(core_algos: Any, loss_fn: Callable[..., Any]) -> None:
    """Refuse ``loss_fn`` unless it accepts every keyword the installed release calls losses with."""
    installed = verl_version()
    called_with = tuple(inspect.signature(core_algos.get_policy_loss_fn("vanilla")).parameters)
    expected = POLICY_LOSS_CALL_KEYWORDS.get(installed[:2])
    try:
        inspect.signature(loss_fn).bind(**dict.fromkeys(called_with))
    except TypeError as error:
        raise RuntimeError(
            f"verl {'.'.join(map(str, installed))} calls policy losses with {called_with}, which "
            f"{loss_fn.__qualname__} does not accept ({error}); agl-algos supports verl {SUPPORTED_VERL}"
        ) from error
    if expected is not None and called_with != expected:
        _LOG.warning(
            "verl %s calls policy losses with %s, not %s as its release line did when agl-algos was "
            "checked; the loss accepts them and is registered",
            ".".join(map(str, installed)),
            called_with,
            expected,
        )


def verl_policy_losses() -> dict[str, Callable[..., Any]]:
    """verl's policy-loss registry itself (``POLICY_LOSS_REGISTRY``), by loss mode."""
    return _core_algos().POLICY_LOSS_REGISTRY


def register_policy_loss(name: str, loss_fn: Callable[..., Any]) -> None:
    """Put ``loss_fn`` into verl's policy-loss registry under ``name``; a no-op if it is there already.

    A different function under the same name (e.g. Agent Lightning's) is replaced with a warning.
    """
    core_algos = _core_algos()
    registry: dict[str, Any] = core_algos.POLICY_LOSS_REGISTRY
    current = registry.get(name)
    if current is loss_fn:
        return
    _check_policy_loss_signature(core_algos, loss_fn)
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
