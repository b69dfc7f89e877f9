"""Checks of verl's own keys that verl itself makes late, or not at all: each raises a
``ValueError`` naming the key and the fix before Ray starts or any rollout is spent."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

GPU_ROLLOUT_BACKENDS = ("vllm", "sglang", "trtllm")
"""verl's rollout backends, all of which need GPUs."""
PROCESSED_LOGPROBS = "processed_logprobs"


def check_verl_keys(
    config: DictConfig,
    *,
    uses_verl_replicas: bool,
    model_name: str,
    routing_replay_key: str | None,
    lora_rank: int,
) -> None:
    """Every check below that applies; ``model_name`` is the gateway's model name, ``lora_rank`` the
    parsed ``actor_rollout_ref.model.lora_rank``."""
    if uses_verl_replicas:
        _check_replicas_can_run_on_device(config)
        _check_replica_parallelism(config)
        _check_logprobs_mode(config)
        _check_replica_model_name(config, model_name)
    _check_loss_mode_registered(str(config.actor_rollout_ref.actor.policy_loss.loss_mode))
    if lora_rank > 0:
        _check_lora_target_modules(config)
    if routing_replay_key is not None:
        _check_router_replay(config, routing_replay_key)


def _check_lora_target_modules(config: DictConfig) -> None:
    """Each of ``actor_rollout_ref.model.target_modules`` must name layers of the model (PEFT's rule: a
    list entry is a name or a dotted suffix, a string other than ``all-linear`` a regular expression
    over full names). verl finds out inside its workers, with PEFT's error in a Ray traceback. A model
    that is not a local folder is left to verl (its config cannot be read offline)."""
    model_path = Path(str(config.actor_rollout_ref.model.path))
    targets: Any = OmegaConf.select(config, "actor_rollout_ref.model.target_modules", default="all-linear")
    if isinstance(targets, ListConfig):
        targets = [str(target) for target in targets]
    if targets == "all-linear" or not (model_path / "config.json").is_file():
        return
    names = _linear_layer_names(model_path)
    if not names:
        return
    if isinstance(targets, str):
        missing = [] if any(re.fullmatch(targets, name) for name in names) else [targets]
    else:
        missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if missing:
        leaves = sorted({name.rsplit(".", 1)[-1] for name in names})
        raise ValueError(
            f"actor_rollout_ref.model.target_modules names {missing}, which the model at {model_path} does not "
            f"have; its linear layers are {leaves} (or use all-linear)"
        )


def _linear_layer_names(model_path: Path) -> list[str]:
    """Full names of the model's linear layers, from its config alone (built on the meta device);
    none when transformers cannot build it as a causal LM that way (a vision-language model, remote
    code): verl's own check then applies."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    except (ValueError, OSError, ImportError, KeyError):
        return []
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def _check_replicas_can_run_on_device(config: DictConfig) -> None:
    backend = str(config.actor_rollout_ref.rollout.name)
    if backend in GPU_ROLLOUT_BACKENDS and str(config.trainer.device) == "cpu":
        raise ValueError(
            f"agentlightning.external_servers.endpoints is empty, so agl would start verl's {backend} replicas "
            "(actor_rollout_ref.rollout.name), which need GPUs; with trainer.device=cpu give the OpenAI base "
            "URL of a CPU vLLM server (e.g. agentlightning.external_servers.endpoints=[http://127.0.0.1:8000/v1])"
        )


def _check_replica_parallelism(config: DictConfig) -> None:
    """verl's replicas must tile the actor's GPUs: a replica of tp x dp x pp GPUs sits within one node
    (a divisor of its GPUs) or spans whole nodes. verl itself finds out with a bare assert in every
    worker, after the model is loaded."""
    rollout, trainer = config.actor_rollout_ref.rollout, config.trainer
    tp = int(rollout.tensor_model_parallel_size)
    per_replica = tp * int(rollout.data_parallel_size) * int(rollout.pipeline_model_parallel_size)
    per_node, nodes = int(trainer.n_gpus_per_node), int(trainer.nnodes)
    if per_replica <= per_node:
        fits = per_node % per_replica == 0
    else:
        fits = per_replica % per_node == 0 and nodes % (per_replica // per_node) == 0
    if not fits:
        raise ValueError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} gives vLLM replicas of {per_replica} GPUs "
            f"(x data_parallel_size x pipeline_model_parallel_size), which do not tile trainer.n_gpus_per_node="
            f"{per_node} x trainer.nnodes={nodes}; set actor_rollout_ref.rollout.tensor_model_parallel_size to "
            f"a divisor of {per_node} (1 runs on any GPU count)"
        )


def _check_logprobs_mode(config: DictConfig) -> None:
    mode = str(config.actor_rollout_ref.rollout.logprobs_mode)
    if mode != PROCESSED_LOGPROBS:
        raise ValueError(
            f"actor_rollout_ref.rollout.logprobs_mode={mode!r}: the replicas would record log-probs that differ "
            "from the actor's log_softmax(logits / temperature) whenever temperature != 1, and importance "
            f"sampling compares the two; set actor_rollout_ref.rollout.logprobs_mode={PROCESSED_LOGPROBS}"
        )


def _check_replica_model_name(config: DictConfig, expected: str) -> None:
    engine_kwargs: Any = OmegaConf.select(
        config, "actor_rollout_ref.rollout.engine_kwargs.vllm", default=None
    )
    chosen = engine_kwargs.get("served_model_name") if engine_kwargs else None
    if chosen is not None and str(chosen) != expected:
        raise ValueError(
            f"actor_rollout_ref.rollout.engine_kwargs.vllm.served_model_name={chosen!r}, but the gateway sends "
            f"every call as model {expected!r} (agentlightning.served_model_name, else the model path), so "
            "every call would be a 404; drop the engine_kwargs key (agl sets it) or make the two names equal"
        )


def _check_loss_mode_registered(loss_mode: str) -> None:
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    from agl_algos.verl import register

    register()

    if loss_mode not in POLICY_LOSS_REGISTRY:
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode!r} is not registered in verl; "
            f"registered: {sorted(POLICY_LOSS_REGISTRY)}"
        )


def _check_router_replay(config: DictConfig, key: str) -> None:
    strategy = str(config.actor_rollout_ref.actor.strategy)
    engine = key.split(".")[2]
    if strategy != engine:
        raise ValueError(
            f"{key}=R3 replays the inference engine's MoE routes in verl's {engine} engine, but "
            f"actor_rollout_ref.actor.strategy={strategy} would train without them; set the strategy to "
            f"{engine} or {key}=disabled"
        )


__all__ = ("GPU_ROLLOUT_BACKENDS", "PROCESSED_LOGPROBS", "check_verl_keys")
