"""agl-types: the wire models of agl-server and the learning-side data models of agl."""

from importlib.metadata import version as _version

from agl_types.learning import CompletedRollout, EnqueuedRollout, TokenId, Triplet
from agl_types.wire import (
    DEFAULT_ATTEMPT_ID,
    TERMINAL_STATES,
    VALID_TRANSITIONS,
    Event,
    EventCreate,
    ModelRegistration,
    ModelRequestData,
    PauseRequest,
    PauseState,
    RewardData,
    Rollout,
    RolloutConfig,
    RolloutCreate,
    RolloutDetail,
    RolloutK8sConfig,
    RolloutLifecycleStatus,
    RolloutLocalConfig,
    RolloutMetadata,
    RolloutPatch,
    RolloutState,
    RolloutStatusPatch,
    ServerRef,
    TerminalRolloutItem,
    TerminalRolloutsPage,
    TripletModelRequestData,
    is_terminal,
)

__version__ = _version("agl-types")

__all__ = (
    # learning side
    "CompletedRollout",
    "EnqueuedRollout",
    "TokenId",
    "Triplet",
    # wire: rollouts
    "DEFAULT_ATTEMPT_ID",
    "TERMINAL_STATES",
    "VALID_TRANSITIONS",
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
    "TerminalRolloutItem",
    "TerminalRolloutsPage",
    "is_terminal",
    # wire: events
    "Event",
    "EventCreate",
    "ModelRequestData",
    "RewardData",
    "ServerRef",
    "TripletModelRequestData",
    # wire: gateway
    "ModelRegistration",
    "PauseRequest",
    "PauseState",
    "__version__",
)
