"""agl-adapter: multi-turn traces (Triplets) → padded verl training tensors, fast and exact."""

from importlib.metadata import version as _version

from agl_adapter._images import load_image
from agl_adapter.adapter import TRACE_AGGREGATOR_LEVELS, Metrics, RolloutAdapter, TraceAggregatorLevel
from agl_adapter.batch import AdapterBatch
from agl_adapter.errors import EmptyBatchError, InvalidImagesError, InvalidRoutesError, InvalidTraceError
from agl_adapter.mismatch import (
    MISMATCH_COLUMNS,
    JsonlMismatchSink,
    LogMismatchSink,
    MismatchEntry,
    MismatchSink,
    WandbMismatchSink,
    default_mismatch_sink,
)
from agl_adapter.padding import (
    get_left_padded_ids_and_attention_mask,
    get_right_padded_ids_and_attention_mask,
    ids_startswith,
)
from agl_adapter.trajectories import (
    TRACE_MERGE_MISMATCHES,
    TRAIN_TRAJECTORIES,
    TRAJECTORY_INDEX_COLUMNS,
    VALIDATION_TRAJECTORIES,
    ArtifactSink,
    MismatchClass,
    TrajectoryRecord,
    ZippedJsonlArtifacts,
    trajectory_records,
)

__version__ = _version("agl-adapter")

__all__ = (
    # adapter
    "RolloutAdapter",
    "AdapterBatch",
    "Metrics",
    "TraceAggregatorLevel",
    "TRACE_AGGREGATOR_LEVELS",
    # errors
    "EmptyBatchError",
    "InvalidTraceError",
    "InvalidRoutesError",
    "InvalidImagesError",
    # images
    "load_image",
    # trace-merge mismatches
    "MISMATCH_COLUMNS",
    "MismatchEntry",
    "MismatchSink",
    "LogMismatchSink",
    "JsonlMismatchSink",
    "WandbMismatchSink",
    "default_mismatch_sink",
    # per-step trajectory artifacts
    "ArtifactSink",
    "MismatchClass",
    "ZippedJsonlArtifacts",
    "TrajectoryRecord",
    "trajectory_records",
    "TRAIN_TRAJECTORIES",
    "VALIDATION_TRAJECTORIES",
    "TRACE_MERGE_MISMATCHES",
    "TRAJECTORY_INDEX_COLUMNS",
    # list helpers
    "ids_startswith",
    "get_left_padded_ids_and_attention_mask",
    "get_right_padded_ids_and_attention_mask",
    "__version__",
)
