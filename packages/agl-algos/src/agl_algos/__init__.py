"""agl-algos: rollout-level GRPO advantage, per-rollout losses (PPO, CISPO, GSPO), zero-advantage
selection, DAPO's overlong shaping and dynamic-sampling filter.

Torch and numpy only; ``agl_algos.verl`` (imported on demand) registers the losses into verl.
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
from agl_algos.dapo import (
    GroupFilter,
    OverlongBuffer,
    filter_zero_variance_groups,
    overlong_reward_penalty,
)
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
    CISPO_PER_ROLLOUT_MEAN_LOSS_MODE,
    GEO_MEAN_PER_ROLLOUT_LOSS_MODE,
    GSPO_LOG_RATIO_MAX,
    GSPO_PER_ROLLOUT_LOSS_MODE,
    LOG_RATIO_CLAMP,
    PER_ROLLOUT_MEAN_LOSS_MODE,
    ROLLOUT_DIVISORS,
    ROLLOUT_LOSS_AGG_MODES,
    RolloutDivisor,
    RolloutLossAggMode,
    compute_policy_loss_cispo_per_rollout_mean,
    compute_policy_loss_geo_mean_per_rollout,
    compute_policy_loss_gspo_per_rollout,
    compute_policy_loss_per_rollout_mean,
    normalize_advantages_by_rollout,
    rollout_index_context,
    rollout_index_of,
    rollout_token_totals,
    rows_per_rollout_metrics,
)

__version__ = _version("agl-algos")

__all__ = (
    "CISPO_PER_ROLLOUT_MEAN_LOSS_MODE",
    "GRPO_EPSILON",
    "GSPO_LOG_RATIO_MAX",
    "GEO_MEAN_PER_ROLLOUT_LOSS_MODE",
    "GSPO_PER_ROLLOUT_LOSS_MODE",
    "LOG_RATIO_CLAMP",
    "PER_ROLLOUT_MEAN_LOSS_MODE",
    "ROLLOUT_DIVISORS",
    "ROLLOUT_LOSS_AGG_MODES",
    "AlgosError",
    "GroupFilter",
    "MissingFieldError",
    "OverlongBuffer",
    "PolicyLossConfig",
    "RemaxNotSupportedError",
    "RolloutConsistencyError",
    "RolloutDivisor",
    "RolloutLossAggMode",
    "RolloutLayout",
    "RolloutLevelAdvantage",
    "RowSelection",
    "__version__",
    "broadcast_rollout_scalars",
    "compute_policy_loss_cispo_per_rollout_mean",
    "compute_policy_loss_geo_mean_per_rollout",
    "compute_policy_loss_gspo_per_rollout",
    "compute_policy_loss_per_rollout_mean",
    "compute_rollout_level_advantage",
    "extract_rollout_scalars",
    "filter_zero_variance_groups",
    "grpo_group_metrics",
    "grpo_outcome_advantage",
    "mini_batch_keep_count",
    "normalize_advantages_by_rollout",
    "overlong_reward_penalty",
    "rollout_index_context",
    "rollout_index_of",
    "rollout_layout",
    "rollout_token_totals",
    "row_rewards_from_scores",
    "rows_per_rollout_metrics",
    "same_reward_group_rows",
    "select_rows_to_keep",
    "zero_advantage_drop_order",
)
