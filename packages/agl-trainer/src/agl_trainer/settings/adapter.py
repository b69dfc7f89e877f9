"""``AdapterSettings``: how agl-adapter turns a step's rollouts into training rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from agl_adapter import RolloutAdapter, TraceAggregatorLevel, ZippedJsonlArtifacts
from agl_trainer.settings.pipeline import routing_replay_key
from agl_trainer.settings.values import (
    flag,
    integer,
    number,
    one_of,
    optional_integer,
    select,
    select_or_null,
    text,
)


@dataclass(frozen=True, kw_only=True)
class AdapterSettings:
    """``agentlightning.trace_aggregator``, the reward and trajectory keys, and R3's routes."""

    level: TraceAggregatorLevel
    max_prompt_length: int
    max_response_length: int
    reward_fillna_value: float
    drop_failed_rollouts: bool
    trajectories_dir: str | None
    max_train_trajectories: int | None
    routing_replay_key: str | None
    """The verl key that set router replay to R3, when one did: rows must then carry MoE routes."""

    def build(self, tokenizer: Any, processor: Any | None = None) -> RolloutAdapter:
        """The adapter, padding with ``tokenizer``'s pad id (0 if none); ``processor`` is the model's
        HF processor when it is a vision-language model."""
        return RolloutAdapter(
            max_prompt_length=self.max_prompt_length,
            max_response_length=self.max_response_length,
            pad_token_id=getattr(tokenizer, "pad_token_id", None) or 0,
            trace_aggregator_level=self.level,
            reward_fillna_value=self.reward_fillna_value,
            tokenizer=tokenizer,
            drop_failed_rollouts=self.drop_failed_rollouts,
            artifact_sink=ZippedJsonlArtifacts(self.trajectories_dir) if self.trajectories_dir else None,
            max_train_trajectories=self.max_train_trajectories,
            require_routed_experts=self.routing_replay_key is not None,
            processor=processor,
        )


def parse_adapter(config: DictConfig) -> AdapterSettings:
    levels: tuple[TraceAggregatorLevel, ...] = ("transition", "trajectory")
    level: TraceAggregatorLevel = one_of(
        "agentlightning.trace_aggregator.level",
        select(config, "agentlightning.trace_aggregator.level"),
        levels,
    )
    prompt_key, response_key = "data.max_prompt_length", "data.max_response_length"
    # verl reads these at every level (vLLM's max_new_tokens among them): checked even when unused here.
    prompt = integer(prompt_key, select(config, prompt_key), minimum=1)
    response = integer(response_key, select(config, response_key), minimum=1)
    if level == "trajectory":
        aggregator = "agentlightning.trace_aggregator"
        prompt_key, response_key = (
            f"{aggregator}.trajectory_max_prompt_length",
            f"{aggregator}.trajectory_max_response_length",
        )
        prompt = select(config, prompt_key, prompt)
        response = select(config, response_key, response)
    records_key = "agentlightning.trajectories.max_train_records"
    return AdapterSettings(
        level=level,
        max_prompt_length=integer(prompt_key, prompt, minimum=1),
        max_response_length=integer(response_key, response, minimum=1),
        reward_fillna_value=number(
            "agentlightning.reward_fillna_value", config.agentlightning.reward_fillna_value
        ),
        drop_failed_rollouts=flag(
            "agentlightning.drop_failed_rollouts",
            select(config, "agentlightning.drop_failed_rollouts", False),
        ),
        trajectories_dir=text(select(config, "agentlightning.trajectories.dir")),
        max_train_trajectories=optional_integer(
            records_key, select_or_null(config, records_key, 24), minimum=0
        ),
        routing_replay_key=routing_replay_key(config),
    )


__all__ = ("AdapterSettings", "parse_adapter")
