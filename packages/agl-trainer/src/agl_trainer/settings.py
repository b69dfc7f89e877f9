"""The ``agentlightning`` section of the config as typed settings, and start-up validation.

Every invalid combination fails here with a ``ValueError`` naming the key, before Ray starts
or any rollout is spent (the reference raises some of these only after a round of rollouts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from agl_adapter import RolloutAdapter, ZippedJsonlArtifacts
from agl_rollout import Admission, StalenessGate
from agl_trainer.serving.drain import Drain

TRACE_AGGREGATOR_LEVELS = ("transition", "trajectory")
PROCESSED_LOGPROBS = "processed_logprobs"
GPU_ROLLOUT_BACKENDS = ("vllm", "sglang", "trtllm")
"""verl's rollout backends, all of which need GPUs."""
ROUTER_REPLAY_KEYS = (
    "actor_rollout_ref.actor.megatron.router_replay.mode",
    "actor_rollout_ref.actor.veomni.router_replay.mode",
)
"""Where verl's engines with MoE router replay read its mode; ``R3`` replays the inference engine's routes."""


@dataclass(frozen=True, kw_only=True)
class AglSettings:
    """What agl reads from ``agentlightning.*`` (and the few verl keys it interprets)."""

    agl_base_url: str
    agl_key: str
    hooks: str | None
    rollout_timeout_seconds: float
    poll_interval_seconds: float
    max_poll_interval_seconds: float | None
    local_agent_class: str | None
    local_env_map: dict[str, str]
    k8s_job_template_path: str | None
    reward_fillna_value: float
    drop_failed_rollouts: bool
    max_ppo_update_times: int | None
    level: str
    max_prompt_length: int
    max_response_length: int
    async_enabled: bool
    async_train_batch_size: int | None
    fully_async: bool
    max_staleness: int | None
    stale_strategy: str
    max_groups_in_flight: int | None
    behaviour_weight_cap: float | None
    """``fully_async.behaviour_weight_cap`` as configured (see :attr:`default_behaviour_weight_cap`)."""
    drain_timeout_seconds: float
    drain_poll_interval_seconds: float
    external_endpoints: tuple[str, ...]
    weights_dir: str | None
    trajectories_dir: str | None
    max_train_trajectories: int | None
    routing_replay_key: str | None
    """The verl key that set router replay to R3, when one did: rows must then carry MoE routes."""

    @property
    def uses_verl_replicas(self) -> bool:
        """Path 1: no external endpoints, so verl's hybrid-engine vLLM replicas serve the agents."""
        return not self.external_endpoints

    def admission(self, train_batch_size: int, gen_batch_size: int) -> Admission:
        """The collector's admission rule for the configured mode (see :class:`agl_rollout.Admission`)."""
        if self.fully_async:
            # (K + 1) steps' groups; with no bound, as many as with the default K = 2.
            bound = 2 if self.max_staleness is None else self.max_staleness
            max_groups = self.max_groups_in_flight or (bound + 1) * gen_batch_size
            return Admission(gen_batch_size, max_groups, self.max_staleness, overlap=True)
        if self.async_enabled:
            return Admission(train_batch_size, int(self.async_train_batch_size or 0), None, overlap=False)
        return Admission(gen_batch_size, gen_batch_size, 0, overlap=False)

    @property
    def default_behaviour_weight_cap(self) -> float | None:
        """The cap of the off-policy weight trained by default: fully async with stale samples allowed
        (``max_staleness`` != 0), else None (see :func:`agl_trainer.step.correction.training_correction`)."""
        if self.fully_async and self.max_staleness != 0:
            return self.behaviour_weight_cap
        return None

    @property
    def staleness_gate(self) -> StalenessGate:
        """Which complete groups are too old to train: sync groups never span a publish, carry-over
        groups may (the reference's rule: no bound); fully async applies its bound."""
        if self.fully_async:
            return StalenessGate(self.max_staleness, self.stale_strategy)  # pyright: ignore[reportArgumentType]  (validated)
        return StalenessGate(None if self.async_enabled else 0)

    def adapter(self, tokenizer: Any, processor: Any | None = None) -> RolloutAdapter:
        """The adapter these settings describe, padding with ``tokenizer``'s pad id (0 if none);
        ``processor`` is the model's HF processor when it is a vision-language model."""
        return RolloutAdapter(
            max_prompt_length=self.max_prompt_length,
            max_response_length=self.max_response_length,
            pad_token_id=getattr(tokenizer, "pad_token_id", None) or 0,
            trace_aggregator_level=self.level,  # pyright: ignore[reportArgumentType]  (validated)
            reward_fillna_value=self.reward_fillna_value,
            tokenizer=tokenizer,
            drop_failed_rollouts=self.drop_failed_rollouts,
            artifact_sink=ZippedJsonlArtifacts(self.trajectories_dir) if self.trajectories_dir else None,
            max_train_trajectories=self.max_train_trajectories,
            require_routed_experts=self.routing_replay_key is not None,
            processor=processor,
        )

    @property
    def drain(self) -> Drain:
        """How the gateway is paused and drained before weights change."""
        return Drain(self.drain_timeout_seconds, self.drain_poll_interval_seconds)

    @classmethod
    def from_config(cls, config: DictConfig) -> AglSettings:
        agl = config.agentlightning
        level = str(agl.trace_aggregator.level)
        if level == "trajectory":
            prompt_len = agl.trace_aggregator.get(
                "trajectory_max_prompt_length", config.data.max_prompt_length
            )
            response_len = agl.trace_aggregator.get(
                "trajectory_max_response_length", config.data.max_response_length
            )
        else:
            prompt_len, response_len = config.data.max_prompt_length, config.data.max_response_length
        external = agl.get("external_servers") or {}
        fully_async = agl.get("fully_async") or {}
        env_map: Any = OmegaConf.to_container(agl.local.env_map) if agl.local.env_map else {}
        trajectories = agl.get("trajectories") or {}
        return cls(
            agl_base_url=str(agl.agl_base_url),
            agl_key=str(agl.agl_key or ""),
            hooks=agl.hooks,
            rollout_timeout_seconds=float(agl.rollout_timeout_seconds),
            poll_interval_seconds=float(agl.get("poll_interval_seconds", 1.0)),
            max_poll_interval_seconds=_optional_float(agl.get("max_poll_interval_seconds")),
            local_agent_class=agl.local.agent_class,
            local_env_map={str(k): str(v) for k, v in env_map.items()},
            k8s_job_template_path=agl.k8s.job_template_path,
            reward_fillna_value=float(agl.reward_fillna_value),
            drop_failed_rollouts=bool(agl.get("drop_failed_rollouts", False)),
            max_ppo_update_times=agl.max_ppo_update_times,
            level=level,
            max_prompt_length=int(prompt_len),
            max_response_length=int(response_len),
            async_enabled=bool(agl.async_rollout.enabled),
            async_train_batch_size=agl.async_rollout.async_train_batch_size,
            fully_async=bool(fully_async.get("enabled", False)),
            max_staleness=_optional_int(fully_async.get("max_staleness")),
            stale_strategy=str(fully_async.get("stale_strategy", "drop")),
            max_groups_in_flight=_optional_int(fully_async.get("max_groups_in_flight")),
            behaviour_weight_cap=_optional_float(fully_async.get("behaviour_weight_cap", 2.0)),
            drain_timeout_seconds=float(agl.get("drain_timeout_seconds", 600)),
            drain_poll_interval_seconds=float(agl.get("drain_poll_interval_seconds", 0.25)),
            external_endpoints=tuple(str(e) for e in external.get("endpoints", []) or []),
            weights_dir=external.get("weights_dir"),
            trajectories_dir=_optional_str(trajectories.get("dir")),
            max_train_trajectories=_records_limit(trajectories.get("max_train_records", 24)),
            routing_replay_key=_r3_key(config),
        )


def _r3_key(config: DictConfig) -> str | None:
    for key in ROUTER_REPLAY_KEYS:
        if str(OmegaConf.select(config, key, default="disabled")) == "R3":
            return key
    return None


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _records_limit(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"agentlightning.trajectories.max_train_records must be null or an int >= 0, got {value!r}"
        )
    return value


def _optional_str(value: Any) -> str | None:
    return None if value is None or value == "" else str(value)


def batch_sizes(config: DictConfig) -> tuple[int, int]:
    """(``data.train_batch_size``, the generation batch: ``data.gen_batch_size``, else the train batch)."""
    train_batch_size = int(config.data.train_batch_size)
    return train_batch_size, int(config.data.get("gen_batch_size") or train_batch_size)


def validate_config(config: DictConfig) -> AglSettings:
    """Check every combination agl cannot train with; return the typed settings.

    Raises ``ValueError`` naming the offending key and what would fix it.
    """
    settings = AglSettings.from_config(config)
    train_batch_size, gen_batch_size = batch_sizes(config)
    if settings.level not in TRACE_AGGREGATOR_LEVELS:
        raise ValueError(
            f"agentlightning.trace_aggregator.level is {settings.level!r}; "
            f"supported: {list(TRACE_AGGREGATOR_LEVELS)}"
        )
    if settings.async_enabled and (
        settings.async_train_batch_size is None or settings.async_train_batch_size <= train_batch_size
    ):
        raise ValueError(
            f"agentlightning.async_rollout.async_train_batch_size ({settings.async_train_batch_size}) must be "
            f"> data.train_batch_size ({train_batch_size}) when agentlightning.async_rollout.enabled=true"
        )
    _check_fully_async(settings)
    groups = settings.max_groups_in_flight
    if settings.fully_async and groups is not None and groups < gen_batch_size:
        raise ValueError(
            f"agentlightning.fully_async.max_groups_in_flight must be null or >= {gen_batch_size} (one step's "
            f"generation batch, data.gen_batch_size or data.train_batch_size), got {groups}"
        )
    if str(config.algorithm.adv_estimator).lower() == "remax":
        raise ValueError(
            "algorithm.adv_estimator=remax is not supported by agl (its baseline needs in-process greedy "
            "generation); use grpo, rloo or another outcome estimator"
        )
    if str(config.algorithm.adv_estimator).lower() == "gae" and config.algorithm.get(
        "enable_rollout_level_advantage", False
    ):
        raise ValueError(
            "algorithm.enable_rollout_level_advantage=true needs an outcome estimator (one scalar per "
            "rollout), but algorithm.adv_estimator=gae gives per-token advantages; set "
            "algorithm.enable_rollout_level_advantage=false to train with GAE and a critic"
        )
    if settings.max_ppo_update_times is not None and settings.max_ppo_update_times < 1:
        raise ValueError(
            f"agentlightning.max_ppo_update_times must be null or >= 1, got {settings.max_ppo_update_times}"
        )
    if settings.rollout_timeout_seconds <= 0:
        raise ValueError(
            f"agentlightning.rollout_timeout_seconds must be > 0, got {settings.rollout_timeout_seconds}"
        )
    cap = settings.max_poll_interval_seconds
    if cap is not None and not cap >= settings.poll_interval_seconds:
        raise ValueError(
            f"agentlightning.max_poll_interval_seconds must be null or >= agentlightning.poll_interval_seconds "
            f"({settings.poll_interval_seconds}), got {cap}"
        )
    for key in ("drain_timeout_seconds", "drain_poll_interval_seconds"):
        if not getattr(settings, key) > 0:
            raise ValueError(f"agentlightning.{key} must be > 0, got {getattr(settings, key)}")
    if settings.uses_verl_replicas:
        _check_replicas_can_run_on_device(config)
        _check_replica_parallelism(config)
        _check_logprobs_mode(config)
        _check_replica_model_name(config)
    _check_loss_mode_registered(str(config.actor_rollout_ref.actor.policy_loss.loss_mode))
    _check_router_replay(config, settings)
    _check_algorithm_stages(config, settings)
    return settings


def _check_algorithm_stages(config: DictConfig, settings: AglSettings) -> None:
    """Per-rollout normalisation, overlong shaping and dynamic sampling read their keys here first."""
    from agl_trainer.step.dynamic_sampling import DynamicSampling
    from agl_trainer.step.overlong import OverlongShaping
    from agl_trainer.step.rollout_normalization import RolloutNormalization

    RolloutNormalization.from_config(config)
    OverlongShaping.from_config(config, settings.max_response_length)
    DynamicSampling.from_config(config, settings.reward_fillna_value)


def _check_fully_async(settings: AglSettings) -> None:
    from agl_rollout import STALE_STRATEGIES

    if not settings.fully_async:
        return
    if settings.async_enabled:
        raise ValueError(
            "agentlightning.fully_async.enabled=true and agentlightning.async_rollout.enabled=true are two "
            "different async modes; keep one (fully_async overlaps collection with the update)"
        )
    if settings.uses_verl_replicas:
        raise ValueError(
            "agentlightning.fully_async.enabled=true needs inference servers that keep serving during the "
            "update, but agentlightning.external_servers.endpoints is empty (verl's replicas sleep while the "
            "actor trains on the same GPUs); give external servers or use agentlightning.async_rollout"
        )
    if settings.max_staleness is not None and settings.max_staleness < 0:
        raise ValueError(
            f"agentlightning.fully_async.max_staleness must be null (no bound) or >= 0, got {settings.max_staleness}"
        )
    cap = settings.behaviour_weight_cap
    if cap is not None and not cap > 0:
        raise ValueError(
            f"agentlightning.fully_async.behaviour_weight_cap must be null (no default off-policy weight) or > 0, got {cap}"
        )
    if settings.stale_strategy not in STALE_STRATEGIES:
        raise ValueError(
            f"agentlightning.fully_async.stale_strategy is {settings.stale_strategy!r}; "
            f"supported: {list(STALE_STRATEGIES)}"
        )


def _check_router_replay(config: DictConfig, settings: AglSettings) -> None:
    key = settings.routing_replay_key
    if key is None:
        return
    strategy = str(config.actor_rollout_ref.actor.strategy)
    engine = key.split(".")[2]
    if strategy != engine:
        raise ValueError(
            f"{key}=R3 replays the inference engine's MoE routes in verl's {engine} engine, but "
            f"actor_rollout_ref.actor.strategy={strategy} would train without them; set the strategy to "
            f"{engine} or {key}=disabled"
        )


def gateway_model_name(config: DictConfig) -> str:
    """The model name agents ask for and the gateway rewrites every call to:
    ``agentlightning.served_model_name``, or ``actor_rollout_ref.model.path`` when that is null."""
    return str(config.agentlightning.get("served_model_name") or config.actor_rollout_ref.model.path)


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


def _check_replica_model_name(config: DictConfig) -> None:
    engine_kwargs: Any = OmegaConf.select(
        config, "actor_rollout_ref.rollout.engine_kwargs.vllm", default=None
    )
    chosen = engine_kwargs.get("served_model_name") if engine_kwargs else None
    expected = gateway_model_name(config)
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


__all__ = (
    "GPU_ROLLOUT_BACKENDS",
    "PROCESSED_LOGPROBS",
    "ROUTER_REPLAY_KEYS",
    "TRACE_AGGREGATOR_LEVELS",
    "AglSettings",
    "batch_sizes",
    "gateway_model_name",
    "validate_config",
)
