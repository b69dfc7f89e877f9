"""verl glue of agl-algos: importing this module registers the per-rollout policy losses.

``per_rollout_mean``, ``cispo_per_rollout_mean``, ``gspo_per_rollout`` and ``geo_mean_per_rollout`` go
into verl's policy-loss registry; the last two also need the batch's ``rollout_index`` and the actor's loss function
wrapped in :class:`RolloutIndexLoss` (see :mod:`agl_algos.verl._rollout_index`). On verl 0.9+ (which
has ``token-sum`` aggregation) verl's token-level losses are registered once more as
``rollout_summed:<name>``, summed over tokens for per-rollout advantages
(:mod:`agl_algos.verl._rollout_summed`).

Import it only where verl is installed (``pip install 'agl-algos[verl]'``). Registration is idempotent:
importing twice, calling :func:`register` again or running :func:`register_in_worker` in every Ray
worker leaves one entry in verl's ``POLICY_LOSS_REGISTRY``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agl_algos.loss import (
    CISPO_PER_ROLLOUT_MEAN_LOSS_MODE,
    GEO_MEAN_PER_ROLLOUT_LOSS_MODE,
    GSPO_PER_ROLLOUT_LOSS_MODE,
    PER_ROLLOUT_MEAN_LOSS_MODE,
    compute_policy_loss_cispo_per_rollout_mean,
    compute_policy_loss_geo_mean_per_rollout,
    compute_policy_loss_gspo_per_rollout,
    compute_policy_loss_per_rollout_mean,
)
from agl_algos.verl._compat import (
    SUPPORTED_VERL,
    register_policy_loss,
    verl_policy_losses,
    verl_version,
    warn_if_unsupported,
)
from agl_algos.verl._data_proto import compute_rollout_level_advantage_data_proto
from agl_algos.verl._rollout_index import ROLLOUT_INDEX_KEY, RolloutIndexLoss, with_rollout_index
from agl_algos.verl._rollout_summed import (
    ROLLOUT_SUMMED_PREFIX,
    VERL_TOKEN_LEVEL_LOSSES,
    rollout_summed_name,
    token_summed,
)

__all__ = (
    "CISPO_PER_ROLLOUT_MEAN_LOSS_MODE",
    "GEO_MEAN_PER_ROLLOUT_LOSS_MODE",
    "GSPO_PER_ROLLOUT_LOSS_MODE",
    "PER_ROLLOUT_MEAN_LOSS_MODE",
    "POLICY_LOSSES",
    "ROLLOUT_INDEX_KEY",
    "ROLLOUT_SUMMED_PREFIX",
    "SUPPORTED_VERL",
    "VERL_TOKEN_LEVEL_LOSSES",
    "WORKER_SETUP_HOOK",
    "RolloutIndexLoss",
    "compute_rollout_level_advantage_data_proto",
    "register",
    "register_in_worker",
    "rollout_summed_name",
    "verl_version",
    "with_rollout_index",
)

WORKER_SETUP_HOOK = "agl_algos.verl.register_in_worker"
"""Value for Ray's ``runtime_env["worker_process_setup_hook"]``, so every worker has the losses."""


POLICY_LOSSES: dict[str, Callable[..., tuple[Any, dict[str, Any]]]] = {
    PER_ROLLOUT_MEAN_LOSS_MODE: compute_policy_loss_per_rollout_mean,
    CISPO_PER_ROLLOUT_MEAN_LOSS_MODE: compute_policy_loss_cispo_per_rollout_mean,
    GSPO_PER_ROLLOUT_LOSS_MODE: compute_policy_loss_gspo_per_rollout,
    GEO_MEAN_PER_ROLLOUT_LOSS_MODE: compute_policy_loss_geo_mean_per_rollout,
}
"""The ``actor.policy_loss.loss_mode`` names :func:`register` puts into verl, and their functions."""


def register() -> None:
    """Register every loss of :data:`POLICY_LOSSES` under its name (each checked against verl's call),
    and on verl 0.9+ each of :data:`VERL_TOKEN_LEVEL_LOSSES` it has as ``rollout_summed:<name>``."""
    for name, loss_fn in POLICY_LOSSES.items():
        register_policy_loss(name, loss_fn)
    if verl_version() < (0, 9):
        return
    registry = verl_policy_losses()
    for name in VERL_TOKEN_LEVEL_LOSSES:
        if name in registry:
            register_policy_loss(rollout_summed_name(name), token_summed(registry[name]))


def register_in_worker() -> None:
    """Ray ``worker_process_setup_hook``: register the losses in this worker process."""
    register()


warn_if_unsupported()
register()
