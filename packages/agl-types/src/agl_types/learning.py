"""Learning-side models: what one rollout produced, in the shape the adapter consumes.

Token ids and log-probs are validated once here, at the boundary, so everything
downstream can work on plain lists and tensors without re-checking them.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from agl_types.wire import LogProb, RolloutState, is_terminal

TokenId = Annotated[StrictInt, Field(ge=0)]


def _finite_reward(value: float | None, info: ValidationInfo) -> float | None:
    if value is not None and not math.isfinite(value):
        raise ValueError(f"{info.field_name} is {value}; a reward must be finite or None")
    return value


Reward = Annotated[float | None, AfterValidator(_finite_reward)]


def _ids_summary(ids: list[int]) -> str:
    return f"{len(ids)} ids"


class Triplet(BaseModel):
    """One model call of a rollout: the prompt it saw, what it generated, how likely that was.

    ``reward`` is set on the last triplet of a rollout (its final reward) and is ``None``
    elsewhere or when the rollout earned none; filling it in is the adapter's job.
    ``metadata`` carries e.g. ``{"server": {"model": ..., "version": ...}}``.
    ``routed_experts`` is the call's MoE routing for R3 replay, as the gateway sends it (a base64
    ``.npy`` of shape (tokens, layers, top_k)); the adapter decodes it only when it builds a row.
    ``image_urls`` are the images of the call's request messages, in order (``data:``, ``file://``
    or ``http(s)://`` URLs); None for a call without images or when they were not fetched.
    """

    model_config = ConfigDict(frozen=True)

    prompt_token_ids: list[TokenId]
    response_token_ids: list[TokenId]
    response_log_probs: list[LogProb] | None = None
    reward: Reward = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    routed_experts: str | None = None
    image_urls: list[str] | None = None

    @field_validator("response_log_probs")
    @classmethod
    def _finite_log_probs(cls, value: list[float] | None) -> list[float] | None:
        if value is not None:
            for i, lp in enumerate(value):
                if not math.isfinite(lp):
                    raise ValueError(f"response_log_probs[{i}] is {lp}; log-probs must be finite")
        return value

    @model_validator(mode="after")
    def _log_probs_match_response(self) -> Self:
        lps = self.response_log_probs
        if lps is not None and len(lps) != len(self.response_token_ids):
            raise ValueError(
                f"response_log_probs has {len(lps)} values but response_token_ids has "
                f"{len(self.response_token_ids)}; give one log-prob per response token or None"
            )
        return self

    @property
    def weight_version(self) -> int | None:
        """The weight version of the policy that produced this call, when the server said."""
        server = self.metadata.get("server")
        version = server.get("version") if isinstance(server, dict) else None
        return version if isinstance(version, int) else None

    def __repr__(self) -> str:
        lps = "yes" if self.response_log_probs is not None else "no"
        return (
            f"Triplet(prompt={_ids_summary(self.prompt_token_ids)}, "
            f"response={_ids_summary(self.response_token_ids)}, log_probs={lps}, reward={self.reward})"
        )

    __str__ = __repr__


class EnqueuedRollout(BaseModel):
    """A rollout the trainer has put on the server and is waiting for.

    ``enqueue_time`` is the trainer's clock; ``running_at`` and ``finished_at`` are the
    server's ``status.updated_at`` when the rollout was first seen running and terminal.
    """

    model_config = ConfigDict(validate_assignment=True)

    rollout_id: str = Field(min_length=1)
    data_id: str = Field(min_length=1)
    step: int = Field(ge=0)
    sample_idx_in_step: int = Field(ge=0)
    enqueue_time: float
    input: Any = None
    running_at: float | None = None
    finished_at: float | None = None

    def __repr__(self) -> str:
        return (
            f"EnqueuedRollout(id={self.rollout_id}, data_id={self.data_id}, "
            f"step={self.step}, sample={self.sample_idx_in_step})"
        )

    __str__ = __repr__


class CompletedRollout(BaseModel):
    """A terminal rollout with its triplets, ready for the adapter.

    ``final_reward`` is ``None`` when the agent reported none; ``timed_out`` marks a
    rollout the trainer gave up on after its rollout timeout (its state is then FAILED).
    """

    model_config = ConfigDict(frozen=True)

    rollout_id: str = Field(min_length=1)
    data_id: str = Field(min_length=1)
    step: int = Field(ge=0)
    sample_idx_in_step: int = Field(ge=0)
    enqueue_time: float
    running_at: float | None = None
    finished_at: float | None = None
    final_reward: Reward = None
    triplets: list[Triplet] = Field(default_factory=list)
    rollout_state: RolloutState
    error_message: str | None = None
    timed_out: bool = False
    input: Any = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("rollout_state")
    @classmethod
    def _terminal_state(cls, value: RolloutState) -> RolloutState:
        if not is_terminal(value):
            raise ValueError(
                f"rollout_state is {value.value!r}; a completed rollout must be succeeded or failed"
            )
        return value

    @property
    def succeeded(self) -> bool:
        return self.rollout_state is RolloutState.SUCCEEDED

    def __repr__(self) -> str:
        return (
            f"CompletedRollout(id={self.rollout_id}, data_id={self.data_id}, step={self.step}, "
            f"sample={self.sample_idx_in_step}, state={self.rollout_state.value}, "
            f"reward={self.final_reward}, turns={len(self.triplets)})"
        )

    __str__ = __repr__


__all__ = ("CompletedRollout", "EnqueuedRollout", "TokenId", "Triplet")
