"""verl glue of agl-algos: importing this module registers the ``per_rollout_mean`` policy loss.

Import it only where verl is installed (``pip install 'agl-algos[verl]'``). Registration is idempotent:
importing twice, calling :func:`register` again or running :func:`register_in_worker` in every Ray
worker leaves one entry in verl's ``POLICY_LOSS_REGISTRY``.
"""

from __future__ import annotations

from agl_algos.loss import PER_ROLLOUT_MEAN_LOSS_MODE, compute_policy_loss_per_rollout_mean
from agl_algos.verl._compat import SUPPORTED_VERL, register_policy_loss, verl_version, warn_if_unsupported
from agl_algos.verl._data_proto import compute_rollout_level_advantage_data_proto

__all__ = (
    "PER_ROLLOUT_MEAN_LOSS_MODE",
    "SUPPORTED_VERL",
    "WORKER_SETUP_HOOK",
    "compute_rollout_level_advantage_data_proto",
    "register",
    "register_in_worker",
    "verl_version",
)

WORKER_SETUP_HOOK = "agl_algos.verl.register_in_worker"
"""Value for Ray's ``runtime_env["worker_process_setup_hook"]``, so every worker has the loss."""


def register() -> None:
    """Register :func:`agl_algos.compute_policy_loss_per_rollout_mean` as ``per_rollout_mean``."""
    register_policy_loss(PER_ROLLOUT_MEAN_LOSS_MODE, compute_policy_loss_per_rollout_mean)


def register_in_worker() -> None:
    """Ray ``worker_process_setup_hook``: register the loss in this worker process."""
    register()


warn_if_unsupported()
register()
