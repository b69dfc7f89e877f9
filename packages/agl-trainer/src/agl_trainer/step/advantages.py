"""Pipeline stage 2b: rewards → advantages, rollout-level by default, and the data metrics."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig
from verl import DataProto
from verl.trainer.ppo.core_algos import get_kl_controller
from verl.trainer.ppo.metric_utils import compute_data_metrics
from verl.trainer.ppo.ray_trainer import apply_kl_penalty, compute_advantage

from agl_algos import grpo_group_metrics, row_rewards_from_scores
from agl_algos.verl import compute_rollout_level_advantage_data_proto


class Advantages:
    """Computes ``advantages`` (and ``returns``) on a cut batch in place, as ``algorithm.*`` says."""

    def __init__(self, config: DictConfig, *, use_critic: bool) -> None:
        self.config = config
        self.use_critic = use_critic
        algorithm = config.algorithm
        self.kl_ctrl = get_kl_controller(algorithm.kl_ctrl) if algorithm.use_kl_in_reward else None

    def compute(self, batch: DataProto, metrics: dict[str, Any]) -> None:
        algorithm = self.config.algorithm
        if self.kl_ctrl is not None:
            batch, kl_metrics = apply_kl_penalty(
                batch,
                kl_ctrl=self.kl_ctrl,  # pyright: ignore[reportArgumentType]  (fixed or adaptive)
                kl_penalty=algorithm.kl_penalty,
            )
            metrics.update(kl_metrics)
        else:
            batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
        kwargs: dict[str, Any] = {
            "adv_estimator": algorithm.adv_estimator,
            "gamma": algorithm.gamma,
            "lam": algorithm.lam,
            "num_repeat": int(self.config.actor_rollout_ref.rollout.n),
            "norm_adv_by_std_in_grpo": algorithm.get("norm_adv_by_std_in_grpo", True),
            "config": algorithm,
        }
        if algorithm.get("enable_rollout_level_advantage", False):
            _, adv_metrics = compute_rollout_level_advantage_data_proto(batch, **kwargs)
            metrics.update(adv_metrics)
        else:
            compute_advantage(batch, **kwargs)
        metrics.update(
            grpo_group_metrics(
                batch.non_tensor_batch["uid"], row_rewards_from_scores(batch.batch["token_level_scores"])
            )
        )
        metrics["critic/n_transition_after_dropping"] = len(batch)
        metrics.update(compute_data_metrics(batch=batch, use_critic=self.use_critic))


__all__ = ("Advantages",)
