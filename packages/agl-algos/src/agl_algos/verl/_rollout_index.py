"""How a batch's rollout index reaches a policy loss inside verl's engine workers.

verl 0.8+ engine workers call the actor's loss function (``ppo_loss``) with each micro-batch's whole
TensorDict, but ``ppo_loss`` calls the registered policy loss with fixed keywords: the advantages,
log-probs, mask, config and importance weights, nothing per row beyond them. :class:`RolloutIndexLoss`
wraps the actor's loss function, reads the micro-batch's ``rollout_index`` and makes it visible to
:func:`agl_algos.compute_policy_loss_gspo_per_rollout` for the duration of the call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agl_algos.loss import rollout_index_context

__all__ = ("ROLLOUT_INDEX_KEY", "RolloutIndexLoss", "with_rollout_index")

ROLLOUT_INDEX_KEY = "rollout_index"
"""The batch tensor (N,) int64 holding each row's rollout number, equal for rows of one rollout."""


@dataclass(frozen=True, slots=True)
class RolloutIndexLoss:
    """An actor loss function (``loss_fn(model_output, data, dp_group)``, e.g. verl's ``ppo_loss``
    bound to its config) that runs with ``data[ROLLOUT_INDEX_KEY]`` as the current rollout index
    (None when the micro-batch has none). Picklable; wrapping it again returns it unchanged."""

    inner: Callable[..., Any]

    def __call__(self, model_output: Any, data: Any, dp_group: Any = None) -> Any:
        index = data.get(ROLLOUT_INDEX_KEY, None)
        with rollout_index_context(index):
            return self.inner(model_output=model_output, data=data, dp_group=dp_group)


def with_rollout_index(loss_fn: Callable[..., Any]) -> RolloutIndexLoss:
    """``loss_fn`` wrapped in :class:`RolloutIndexLoss` (itself when it is one already)."""
    return loss_fn if isinstance(loss_fn, RolloutIndexLoss) else RolloutIndexLoss(loss_fn)
