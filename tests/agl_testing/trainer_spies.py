"""Spies on a built ``AglRayPPOTrainer``: every call goes through, and what it was is recorded."""

from __future__ import annotations

from typing import Any


def record_trained_data_ids(trainer: Any) -> list[str]:
    """The data id of every rollout the trainer builds a training batch from, in order."""
    seen: list[str] = []
    build_batch = trainer.adapter.build_batch

    def recording(completed: Any, **kwargs: Any) -> Any:
        seen.extend(rollout.data_id for rollout in completed)
        return build_batch(completed, **kwargs)

    trainer.adapter.build_batch = recording
    return seen


__all__ = ("record_trained_data_ids",)
