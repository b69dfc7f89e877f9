"""Wire models of the execution-side server (``agl-server``, PyPI ``agentlightning`` 1.0.x).

Field names and JSON shapes match what that server accepts and returns; they are checked
against the real process in ``tests/test_types_server_roundtrip.py``. Models the server
closes with ``extra="forbid"`` are closed here too; the others ignore unknown keys so a
newer server never breaks an older client.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictFloat

DEFAULT_ATTEMPT_ID = "0"

# A number, never a string or a bool that pydantic would otherwise coerce. Not capped at 0:
# log-probs are <= 0 in exact arithmetic, but an engine that subtracts a separately computed
# logsumexp can round a near-certain token's just above 0.
LogProb = StrictFloat


class RolloutState(StrEnum):
    """Lifecycle state of a rollout on the server."""

    QUEUING = "queuing"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


TERMINAL_STATES: frozenset[RolloutState] = frozenset({RolloutState.SUCCEEDED, RolloutState.FAILED})

VALID_TRANSITIONS: dict[RolloutState, frozenset[RolloutState]] = {
    RolloutState.QUEUING: frozenset({RolloutState.RUNNING, RolloutState.FAILED}),
    RolloutState.RUNNING: frozenset({RolloutState.SUCCEEDED, RolloutState.FAILED}),
    RolloutState.SUCCEEDED: frozenset(),
    RolloutState.FAILED: frozenset(),
}


def is_terminal(state: RolloutState | str) -> bool:
    """Whether ``state`` is final (no transition leaves it)."""
    return RolloutState(state) in TERMINAL_STATES


class RolloutLocalConfig(BaseModel):
    """How the local runner starts the agent of a rollout."""

    agent_class: str | None = None
    env_map: dict[str, str] = Field(default_factory=dict)


class RolloutK8sConfig(BaseModel):
    """How the Kubernetes runner starts the agent: the Job template text, not a path."""

    job_template: str | None = None


class RolloutConfig(BaseModel):
    """Controller-facing configuration of one rollout."""

    timeout_seconds: int = Field(default=3600, gt=0)
    local: RolloutLocalConfig | None = None
    k8s: RolloutK8sConfig | None = None


class RolloutMetadata(BaseModel):
    """Algorithm-facing context of a rollout; any extra key is kept."""

    model_config = ConfigDict(extra="allow")

    batch_idx: int | None = None
    sample_idx_in_batch: int | None = None
    run_id: str | None = None
    """The trainer process that created the rollout (:class:`agl_rollout.AglClient`'s ``run_id``)."""


class RolloutCreate(BaseModel):
    """One item of the ``POST /api/rollouts`` body.

    A client-chosen ``rollout_id`` makes creation idempotent: the server returns the
    existing rollout instead of creating a second one, so a retried create is safe.
    """

    input: Any
    is_train: bool = True
    config: RolloutConfig | None = None
    metadata: RolloutMetadata | None = None
    rollout_id: str | None = None

    def to_wire(self) -> dict[str, Any]:
        """The JSON body item: unset optionals left out, but ``input`` always present.

        The server requires the ``input`` key even when it is ``null``, so a plain
        ``model_dump(exclude_none=True)`` would be rejected with a 422.
        """
        body = self.model_dump(mode="json", exclude_none=True)
        body["input"] = self.model_dump(mode="json", include={"input"})["input"]
        return body


class RolloutLifecycleStatus(BaseModel):
    """Server-side lifecycle of a rollout; ``updated_at`` moves on every patch."""

    state: RolloutState = RolloutState.QUEUING
    k8s_job_name: str | None = None
    last_attempt_id: str | None = None
    error_message: str | None = None
    version: int = 1
    created_at: float
    updated_at: float


class RolloutStatusPatch(BaseModel):
    """The patchable fields of a rollout's status (the server forbids any other)."""

    model_config = ConfigDict(extra="forbid")

    state: RolloutState | None = None
    k8s_job_name: str | None = None
    last_attempt_id: str | None = None
    error_message: str | None = None


class RolloutPatch(BaseModel):
    """Body of ``PATCH /api/rollouts/{id}``: only the nested status is patchable."""

    status: RolloutStatusPatch | None = None


class Rollout(BaseModel):
    """A unit of agent work as the server stores it."""

    rollout_id: str
    input: Any
    is_train: bool = True
    config: RolloutConfig
    metadata: RolloutMetadata = Field(default_factory=RolloutMetadata)
    status: RolloutLifecycleStatus

    @property
    def state(self) -> RolloutState:
        return self.status.state

    @property
    def visible_attempt_id(self) -> str:
        """The attempt whose events the server returns (``last_attempt_id`` or ``"0"``)."""
        return self.status.last_attempt_id or DEFAULT_ATTEMPT_ID


class RolloutDetail(BaseModel):
    """Answer of ``GET /api/rollouts/{id}``: the rollout and the attempts that have events."""

    rollout: Rollout
    attempts: list[str] = Field(default_factory=list)


class TerminalRolloutItem(BaseModel):
    """One entry of the terminal-rollouts log (no input or config payload)."""

    rollout_id: str
    state: RolloutState
    data_id: str
    is_train: bool


class TerminalRolloutsPage(BaseModel):
    """A page of ``GET /api/rollouts/terminal``; pass ``next_after`` back as ``after``."""

    items: list[TerminalRolloutItem]
    next_after: int
    total_terminal: int


class Event(BaseModel):
    """One event of a rollout attempt; its identity is its position in the attempt's list."""

    event_type: str
    rollout_id: str
    attempt_id: str
    timestamp: float
    data: dict[str, Any] = Field(default_factory=dict)


class EventCreate(BaseModel):
    """Body of ``POST /api/rollouts/{id}/attempt/{aid}/events``."""

    event_type: str = Field(min_length=1)
    data: dict[str, Any] = Field(default_factory=dict)


class ServerRef(BaseModel):
    """Which registered endpoint served a model call, and its weight version.

    The triplet channel trims it to ``model`` and ``version``; the raw event also has ``endpoint``.
    """

    model: str | None = None
    endpoint: str | None = None
    version: int | None = None


class ModelRequestData(BaseModel):
    """Raw payload of a ``model_request`` event, as the gateway proxy records it."""

    model: str
    model_version: int | None = None
    request: dict[str, Any] = Field(default_factory=dict)
    adjusted_params: dict[str, Any] | None = None
    response: dict[str, Any] | list[Any] = Field(default_factory=dict)
    latency_ms: float | None = None
    http_status: int | None = None
    status: str = "ok"
    retry_count: int = 0
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    server: ServerRef | None = None


class TripletModelRequestData(BaseModel):
    """Payload of a ``model_request`` event in the ``format=triplet`` channel."""

    prompt_token_ids: list[int] = Field(default_factory=list)
    response_token_ids: list[int] = Field(default_factory=list)
    response_log_probs: list[LogProb] | None = None
    server: ServerRef = Field(default_factory=ServerRef)
    routed_experts: str | None = None
    """MoE routing of the call (R3): a base64 ``.npy`` of shape (tokens, layers, top_k), present when the
    gateway runs with ``include_routed_experts`` and the server kept it (it drops a call's routes once a
    later call of the same context carries them)."""
    http_status: int | None = None
    status: str | None = None
    error: Any = None

    @property
    def is_error(self) -> bool:
        """A failed upstream call: marked as error, an HTTP status >= 400, or an error body."""
        return (
            self.status == "error"
            or (self.http_status is not None and self.http_status >= 400)
            or self.error is not None
        )


class RewardData(BaseModel):
    """Payload of a ``reward`` event."""

    value: float
    message: str | None = None
    source: str | None = None
    reason: str | None = None


class ModelRegistration(BaseModel):
    """An inference endpoint registered on the gateway, keyed by (model, endpoint).

    ``version`` is the weight version (training step) of the policy it serves; the proxy
    copies it into every ``model_request`` event it records.
    """

    model: str = Field(min_length=1)
    endpoint: str = Field(min_length=1)
    version: int = Field(default=0, ge=0)


class PauseRequest(BaseModel):
    """Body of ``POST /proxy/pause``."""

    retry_after_seconds: int = 5
    reason: str | None = None


class PauseState(BaseModel):
    """Answer of ``/proxy/pause``, ``/proxy/resume`` and ``GET /proxy/state``."""

    paused: bool
    retry_after_seconds: int
    reason: str | None = None
    inflight: int


__all__ = (
    "DEFAULT_ATTEMPT_ID",
    "TERMINAL_STATES",
    "VALID_TRANSITIONS",
    "Event",
    "EventCreate",
    "ModelRegistration",
    "ModelRequestData",
    "PauseRequest",
    "PauseState",
    "RewardData",
    "Rollout",
    "RolloutConfig",
    "RolloutCreate",
    "RolloutDetail",
    "RolloutK8sConfig",
    "RolloutLifecycleStatus",
    "RolloutLocalConfig",
    "RolloutMetadata",
    "RolloutPatch",
    "RolloutState",
    "RolloutStatusPatch",
    "ServerRef",
    "TerminalRolloutItem",
    "TerminalRolloutsPage",
    "TripletModelRequestData",
    "is_terminal",
)
