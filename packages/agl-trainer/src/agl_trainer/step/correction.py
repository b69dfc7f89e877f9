"""Stage: the old log-probs that anchor the PPO ratio, and verl's off-policy correction on them.

The batch's ``rollout_log_probs`` (N, R) are the log-probs of the policy that sampled it (π_rollout,
possibly several weight versions behind); ``old_log_probs`` (N, R) anchor the PPO ratio. Two modes
(see :mod:`agl_trainer.settings.correction` for the keys and the default), both computed by verl's
own helpers (:mod:`verl.trainer.ppo.rollout_corr_helper`):

- **bypass** (``bypass_mode: true``): ``old_log_probs := rollout_log_probs`` and the actor's
  recompute is skipped. With verl's losses, verl's ``bypass_mode`` loss (set on the workers at
  assembly) runs its IS/RS inside the loss against π_θ; with agl's ``per_rollout_mean`` the ratio
  becomes π_θ/π_rollout, which is verl's ``loss_type: ppo_clip`` bypass.
- **decoupled** (``bypass_mode: false``): the actor recomputes ``old_log_probs``, then verl adds
  truncated/masked IS weights (``rollout_is_weights``, which the policy loss multiplies in), applies
  rejection sampling to ``response_mask`` and returns ``rollout_corr/*`` metrics (metrics alone when
  neither ``rollout_is`` nor ``rollout_rs`` is set, as verl's trainer does).
"""

from __future__ import annotations

from collections.abc import Callable

from verl import DataProto
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

from agl_trainer.settings.correction import ROLLOUT_CORRECTION_KEY, RolloutCorrection

__all__ = ("compute_old_log_probs",)


def compute_old_log_probs(
    batch: DataProto,
    correction: RolloutCorrection | None,
    *,
    recompute: Callable[[DataProto], DataProto],
) -> tuple[DataProto, dict[str, float]]:
    """Give ``batch`` its ``old_log_probs``: the rollout's (bypass) or ``recompute``'s, then correct.

    ``recompute`` is the actor's log-prob pass (``PolicyWorkers.compute_log_prob``); only its
    ``old_log_probs`` are kept. Returns the batch and verl's ``rollout_corr/*`` metrics. Raises
    ``ValueError`` when the correction needs ``rollout_log_probs`` and the batch has none.
    """
    if correction is not None and correction.bypass_mode:
        _require_rollout_log_probs(batch, "bypass_mode=true")
        batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
        return batch, {}
    batch = batch.union(recompute(batch).select(batch_keys=["old_log_probs"]))
    # Metrics alone are skipped without rollout log-probs; IS and RS cannot be.
    if correction is None or ("rollout_log_probs" not in batch.batch and not correction.corrects):
        return batch, {}
    _require_rollout_log_probs(
        batch, f"rollout_is={correction.rollout_is!r}, rollout_rs={correction.rollout_rs!r}"
    )
    # verl annotates the section as its dataclass; its own trainer passes the config object too.
    return compute_rollout_correction_and_add_to_batch(batch, correction.as_verl_config())  # pyright: ignore[reportArgumentType]


def _require_rollout_log_probs(batch: DataProto, setting: str) -> None:
    if "rollout_log_probs" not in batch.batch:
        raise ValueError(
            f"{ROLLOUT_CORRECTION_KEY} ({setting}) needs 'rollout_log_probs' in the batch, and this batch "
            "has none: the adapter attaches them only when every row's model calls carry log-probs "
            "(the gateway asks the servers for them on training calls; see the adapter's 'rows lack "
            f"log-probs' warning). Make every call return log-probs, or turn {ROLLOUT_CORRECTION_KEY} off"
        )
