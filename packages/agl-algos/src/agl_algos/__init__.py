"""agl-algos: rollout-level GRPO advantage, per-rollout-mean PPO loss, zero-advantage selection.

Torch and numpy only; ``agl_algos.verl`` (imported on demand) registers the loss into verl.
"""

from importlib.metadata import version as _version

from agl_algos.advantage import (
    GRPO_EPSILON,
    RolloutLayout,
    RolloutLevelAdvantage,
    broadcast_rollout_scalars,
    compute_rollout_level_advantage,
    extract_rollout_scalars,
    grpo_outcome_advantage,
    rollout_layout,
)
from agl_algos.config import PolicyLossConfig
from agl_algos.errors import (
    AlgosError,
    MissingFieldError,
    RemaxNotSupportedError,
    RolloutConsistencyError,
)
from agl_algos.groups import (
    RowSelection,
    grpo_group_metrics,
    mini_batch_keep_count,
    row_rewards_from_scores,
    same_reward_group_rows,
    select_rows_to_keep,
    zero_advantage_drop_order,
)
from agl_algos.loss import (
    LOG_RATIO_CLAMP,
    PER_ROLLOUT_MEAN_LOSS_MODE,
    compute_policy_loss_per_rollout_mean,
    normalize_advantages_by_rollout,
)

__version__ = _version("agl-algos")

__all__ = (
    "GRPO_EPSILON",
    "LOG_RATIO_CLAMP",
    "PER_ROLLOUT_MEAN_LOSS_MODE",
    "AlgosError",
    "MissingFieldError",
    "PolicyLossConfig",
    "RemaxNotSupportedError",
    "RolloutConsistencyError",
    "RolloutLayout",
    "RolloutLevelAdvantage",
    "RowSelection",
    "__version__",
    "broadcast_rollout_scalars",
    "compute_policy_loss_per_rollout_mean",
    "compute_rollout_level_advantage",
    "extract_rollout_scalars",
    "grpo_group_metrics",
    "grpo_outcome_advantage",
    "mini_batch_keep_count",
    "normalize_advantages_by_rollout",
    "rollout_layout",
    "row_rewards_from_scores",
    "same_reward_group_rows",
    "select_rows_to_keep",
    "zero_advantage_drop_order",
)
