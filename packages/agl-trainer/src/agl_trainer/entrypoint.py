"""``run_ppo``: start Ray with agl's worker setup hook, build the trainer on in-memory data, train."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf

from agl_trainer._compat import check_verl_version
from agl_trainer.datasets import InMemoryDataset
from agl_trainer.settings import validate_config
from agl_trainer.trainer import AglRayPPOTrainer
from agl_trainer.weights import ExternalVllmPush, NoWeightPush, WeightPusher
from agl_trainer.workers import ray_runtime_env

CONFIG_DIR = Path(__file__).parent / "config"


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """agl-trainer's Hydra config (verl's ``ppo_trainer`` plus ``agentlightning.*``) with ``overrides``."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="agl_trainer", overrides=list(overrides))


def init_ray(config: DictConfig) -> None:
    """``ray.init`` with agl's runtime env merged under the user's ``ray_kwargs.ray_init`` (user keys win)."""
    if ray.is_initialized():
        return
    section: Any = OmegaConf.select(config, "ray_kwargs.ray_init", default=None)
    ray_init: dict[str, Any] = OmegaConf.to_container(section) if section is not None else {}  # type: ignore[assignment]
    agl_env = ray_runtime_env(str(config.trainer.device))
    user_env = dict(ray_init.pop("runtime_env", None) or {})
    env_vars = {**agl_env["env_vars"], **dict(user_env.pop("env_vars", None) or {})}
    runtime_env = {**agl_env, **user_env, "env_vars": env_vars}
    ray_init = {key: value for key, value in ray_init.items() if value is not None}
    if os.environ.get("RAY_TMPDIR"):
        ray_init.setdefault("_temp_dir", os.environ["RAY_TMPDIR"])
    ray_init.setdefault("include_dashboard", False)
    ray.init(runtime_env=runtime_env, **ray_init)


def default_weight_pusher(config: DictConfig, endpoints: Sequence[str]) -> WeightPusher:
    """External vLLM reload when ``agentlightning.external_servers.weights_dir`` is set, else none."""
    weights_dir = config.agentlightning.external_servers.get("weights_dir")
    if not weights_dir:
        return NoWeightPush()
    return ExternalVllmPush(endpoints, served_model_name(config), Path(weights_dir))


def served_model_name(config: DictConfig) -> str:
    """The model name agents and the gateway use: ``agentlightning.served_model_name`` or the model path."""
    return str(config.agentlightning.get("served_model_name") or config.actor_rollout_ref.model.path)


def build_trainer(
    config: DictConfig,
    train_dataset: Sequence[Mapping[str, Any]],
    val_dataset: Sequence[Mapping[str, Any]],
    *,
    weight_pusher: WeightPusher | None = None,
) -> AglRayPPOTrainer:
    """Validate, start Ray, and build the trainer with its workers (not yet trained)."""
    from verl.utils import hf_tokenizer

    check_verl_version()
    settings = validate_config(config)
    train = InMemoryDataset(train_dataset, name="train_dataset")
    val = InMemoryDataset(val_dataset, name="val_dataset")
    init_ray(config)
    tokenizer = hf_tokenizer(str(config.actor_rollout_ref.model.path))
    trainer = AglRayPPOTrainer(
        config,
        tokenizer,
        train_dataset=train,
        val_dataset=val,
        weight_pusher=weight_pusher or default_weight_pusher(config, settings.external_endpoints),
    )
    trainer.init_workers()
    return trainer


def run_ppo(
    config: DictConfig,
    train_dataset: Sequence[Mapping[str, Any]],
    val_dataset: Sequence[Mapping[str, Any]],
    *,
    weight_pusher: WeightPusher | None = None,
) -> AglRayPPOTrainer:
    """Train on in-memory rows (each row becomes a rollout's ``input``); return the trainer."""
    trainer = build_trainer(config, train_dataset, val_dataset, weight_pusher=weight_pusher)
    trainer.fit()
    return trainer


__all__ = (
    "CONFIG_DIR",
    "build_trainer",
    "compose_config",
    "default_weight_pusher",
    "init_ray",
    "run_ppo",
    "served_model_name",
)
