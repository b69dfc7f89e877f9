"""agl-rollout: queue rollouts on agl-server, wait for them sync or by GRPO group, and turn
their events into CompletedRollouts. No torch, no verl: only httpx and agl-types.
"""

from importlib.metadata import version as _version

from agl_rollout._tracker import WaitCounts
from agl_rollout.async_manager import AsyncRolloutManager, AsyncRolloutState, CarriedGroup
from agl_rollout.batch import Batch, BatchTopUp, batch_len, batch_rows
from agl_rollout.client import PAUSE_TIMEOUT_S, AglClient
from agl_rollout.collector import CollectedGroups, CollectorError, GroupCollector
from agl_rollout.config import RolloutManagerConfig
from agl_rollout.convert import as_reward, to_native
from agl_rollout.errors import (
    AglHTTPError,
    AglServerError,
    AglUnavailableError,
    RolloutsLostError,
)
from agl_rollout.gateway import model_registrations, pause_and_drain
from agl_rollout.hooks import BufferedTraceWriter, HookRunner, RolloutHooks, TraceWriter, load_hooks
from agl_rollout.images import image_urls_per_call, request_image_urls
from agl_rollout.lifecycle import lifecycle_metrics, percentile, record_lifecycle
from agl_rollout.progress import WaitProgress
from agl_rollout.queueing import QueuedBatch, build_requests, enqueue
from agl_rollout.raw_calls import raw_call_per_triplet_call, served_adapter_versions, served_endpoints
from agl_rollout.retry import RetryPolicy
from agl_rollout.staleness import (
    STALE_STRATEGIES,
    Admission,
    StalenessGate,
    StaleStrategy,
    group_age,
    is_ahead,
)
from agl_rollout.sync_manager import RolloutBatchResult, SyncRolloutManager
from agl_rollout.triplets import TripletExtraction, build_completed_rollout, extract_triplets

__version__ = _version("agl-rollout")

__all__ = (
    # client
    "AglClient",
    "PAUSE_TIMEOUT_S",
    "RetryPolicy",
    "AglServerError",
    "AglHTTPError",
    "AglUnavailableError",
    "RolloutsLostError",
    # managers
    "RolloutManagerConfig",
    "SyncRolloutManager",
    "AsyncRolloutManager",
    "AsyncRolloutState",
    "CarriedGroup",
    "RolloutBatchResult",
    "WaitCounts",
    # fully-async collection and the staleness gate
    "GroupCollector",
    "CollectedGroups",
    "CollectorError",
    "Admission",
    "StalenessGate",
    "StaleStrategy",
    "STALE_STRATEGIES",
    "group_age",
    "is_ahead",
    "WaitProgress",
    # queueing and batches
    "Batch",
    "BatchTopUp",
    "QueuedBatch",
    "batch_len",
    "batch_rows",
    "build_requests",
    "enqueue",
    "to_native",
    # events -> rollouts
    "TripletExtraction",
    "as_reward",
    "build_completed_rollout",
    "extract_triplets",
    "image_urls_per_call",
    "raw_call_per_triplet_call",
    "served_adapter_versions",
    "served_endpoints",
    "request_image_urls",
    "lifecycle_metrics",
    "percentile",
    "record_lifecycle",
    # hooks
    "RolloutHooks",
    "TraceWriter",
    "BufferedTraceWriter",
    "HookRunner",
    "load_hooks",
    # gateway
    "model_registrations",
    "pause_and_drain",
    "__version__",
)
