"""MoE routes as the gateway records them (base64 ``.npy``), and one-rollout batches that carry them."""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence

import numpy as np

from agl_types import CompletedRollout, RolloutState, Triplet


def npy_payload(array: np.ndarray) -> str:
    """``array`` as the gateway records a call's ``routed_experts``: a base64 ``.npy``, no pickle."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def succeeded_rollout(
    triplets: Sequence[Triplet], *, rollout_id: str = "r1", sample: int = 0
) -> CompletedRollout:
    """A succeeded rollout of step 0 with reward 1.0, made of ``triplets``."""
    return CompletedRollout(
        rollout_id=rollout_id,
        data_id="d1",
        step=0,
        sample_idx_in_step=sample,
        enqueue_time=0.0,
        final_reward=1.0,
        triplets=list(triplets),
        rollout_state=RolloutState.SUCCEEDED,
    )
