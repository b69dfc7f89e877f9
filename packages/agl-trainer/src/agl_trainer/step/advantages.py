"""Stage 7: rewards → advantages, rollout-level by default, and the data metrics."""

from __future__ import annotations

from typing import Any

from verl import DataProto
from verl.trainer.ppo.core_algos import AdaptiveKLController, FixedKLController, get_kl_controller
from verl.trainer.ppo.metric_utils import compute_data_metrics
from verl.trainer.ppo.ray_trainer import apply_kl_penalty, compute_advantage

from agl_algos import grpo_group_metrics, row_rewards_from_scores
from agl_algos.verl import compute_rollout_level_advantage_data_proto
from agl_trainer.settings import AdvantageSettings

KlController = AdaptiveKLController | FixedKLController


def kl_controller(settings: AdvantageSettings) -> KlController | None:
    """verl's KL controller when ``algorithm.use_kl_in_reward`` (an adaptive one keeps state), else None."""
    algorithm = settings.algorithm
    return get_kl_controller(algorithm["kl_ctrl"]) if algorithm["use_kl_in_reward"] else None  # pyright: ignore[reportArgumentType]


def compute_advantages(
    batch: DataProto, settings: AdvantageSettings, *, kl_ctrl: KlController | None
) -> tuple[DataProto, dict[str, Any]]:
    """``advantages`` (and ``returns``) on a cut batch, as ``algorithm.*`` says."""
    algorithm = settings.algorithm
    metrics: dict[str, Any] = {}
    if kl_ctrl is not None:
        batch, kl_metrics = apply_kl_penalty(
            batch,
            kl_ctrl=kl_ctrl,  # pyright: ignore[reportArgumentType]  (fixed or adaptive)
            kl_penalty=algorithm["kl_penalty"],
        )
        metrics.update(kl_metrics)
    else:
        batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    kwargs: dict[str, Any] = {
        "adv_estimator": algorithm["adv_estimator"],
        "gamma": algorithm["gamma"],
        "lam": algorithm["lam"],
        "num_repeat": settings.num_repeat,
        "norm_adv_by_std_in_grpo": algorithm.get("norm_adv_by_std_in_grpo", True),
        "config": algorithm,
    }
    if settings.rollout_level:
        _, adv_metrics = compute_rollout_level_advantage_data_proto(batch, **kwargs)
        metrics.update(adv_metrics)
    else:
        batch = compute_advantage(batch, **kwargs)
    metrics.update(
        grpo_group_metrics(
            batch.non_tensor_batch["uid"], row_rewards_from_scores(batch.batch["token_level_scores"])
        )
    )
    metrics["critic/n_transition_after_dropping"] = len(batch)
    metrics.update(compute_data_metrics(batch=batch, use_critic=settings.use_critic))
    return batch, metrics


__all__ = ("KlController", "compute_advantages", "kl_controller")
