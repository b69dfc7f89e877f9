"""``format=triplet`` events -> Triplets and the final reward; terminal rollout -> CompletedRollout."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from agl_rollout.convert import as_reward
from agl_rollout.raw_calls import MODEL_REQUEST
from agl_types import CompletedRollout, EnqueuedRollout, Event, Rollout, Triplet, TripletModelRequestData

logger = logging.getLogger("agl_rollout.triplets")


@dataclass(frozen=True)
class TripletExtraction:
    """What a rollout's events amount to: its triplets in call order, the final reward, and how many
    events were unusable (an error call, no response tokens, malformed ids, a non-numeric reward).
    """

    triplets: list[Triplet]
    final_reward: float | None
    n_invalid_events: int


def _triplet(
    event: Event, image_urls: list[str] | None, version: int | None, endpoint: str | None
) -> Triplet | None:
    try:
        data = TripletModelRequestData.model_validate(event.data)
        if data.is_error or not data.response_token_ids:
            return None
        server = data.server.model_dump()
        if version is not None:
            server["version"] = version
        if endpoint is not None:
            server["endpoint"] = endpoint
        return Triplet(
            prompt_token_ids=data.prompt_token_ids,
            response_token_ids=data.response_token_ids,
            response_log_probs=data.response_log_probs,
            metadata={"server": server},
            routed_experts=data.routed_experts,
            image_urls=image_urls or None,
        )
    except ValidationError as exc:
        logger.debug("skipping malformed model_request rollout_id=%s error=%s", event.rollout_id, exc)
        return None


def extract_triplets(
    events: Sequence[Event],
    image_urls: Sequence[list[str]] | None = None,
    versions: Sequence[int | None] | None = None,
    endpoints: Sequence[str | None] | None = None,
) -> TripletExtraction:
    """Build the triplets of one rollout from its ``format=triplet`` events.

    Every valid ``model_request`` becomes a Triplet; the last ``reward`` event with a finite
    numeric ``value`` is the final reward and is also set on the last triplet. Invalid events
    are skipped and counted. Unlike the reference, an invalid later reward does not hide an
    earlier valid one. ``image_urls``, when given, holds each ``model_request``'s images, one list
    per call (:func:`agl_rollout.images.image_urls_per_call`); ``versions``, when given, each
    call's served weight version where known (:func:`agl_rollout.raw_calls.served_adapter_versions`),
    which replaces the version of the registration the gateway recorded; ``endpoints``, when
    given, each call's serving endpoint where known (:func:`agl_rollout.raw_calls.served_endpoints`),
    set as the triplet's ``metadata["server"]["endpoint"]``.
    """
    calls = [event for event in events if event.event_type == MODEL_REQUEST]
    if image_urls is not None and len(image_urls) != len(calls):
        raise ValueError(f"image_urls has {len(image_urls)} lists for {len(calls)} model_request events")
    if versions is not None and len(versions) != len(calls):
        raise ValueError(f"versions has {len(versions)} values for {len(calls)} model_request events")
    if endpoints is not None and len(endpoints) != len(calls):
        raise ValueError(f"endpoints has {len(endpoints)} values for {len(calls)} model_request events")
    triplets: list[Triplet] = []
    final_reward: float | None = None
    n_invalid = 0
    n_calls = 0
    for event in events:
        if event.event_type == MODEL_REQUEST:
            triplet = _triplet(
                event,
                None if image_urls is None else image_urls[n_calls],
                None if versions is None else versions[n_calls],
                None if endpoints is None else endpoints[n_calls],
            )
            n_calls += 1
            if triplet is None:
                n_invalid += 1
            else:
                triplets.append(triplet)
        elif event.event_type == "reward":
            reward = as_reward(event.data.get("value"))
            if reward is None:
                n_invalid += 1
            else:
                final_reward = reward
    if triplets and final_reward is not None:
        triplets[-1] = triplets[-1].model_copy(update={"reward": final_reward})
    return TripletExtraction(triplets=triplets, final_reward=final_reward, n_invalid_events=n_invalid)


def build_completed_rollout(
    enqueued: EnqueuedRollout,
    rollout: Rollout | None,
    extraction: TripletExtraction,
    *,
    timed_out: bool = False,
    error_message: str | None = None,
) -> CompletedRollout:
    """The CompletedRollout of a terminal rollout; ``rollout=None`` when the server's copy is gone
    (a timed-out rollout the server could not be told about): it then counts as failed.
    """
    state = rollout.status.state if rollout is not None else "failed"
    finished_at = enqueued.finished_at
    if finished_at is None and rollout is not None:
        finished_at = rollout.status.updated_at
    return CompletedRollout.model_validate(
        {
            "rollout_id": enqueued.rollout_id,
            "data_id": enqueued.data_id,
            "step": enqueued.step,
            "sample_idx_in_step": enqueued.sample_idx_in_step,
            "enqueue_time": enqueued.enqueue_time,
            "running_at": enqueued.running_at,
            "finished_at": finished_at,
            "final_reward": extraction.final_reward,
            "triplets": extraction.triplets,
            "rollout_state": state,
            "error_message": error_message or (rollout.status.error_message if rollout is not None else None),
            "timed_out": timed_out,
            "input": enqueued.input,
            "metadata": rollout.metadata.model_dump(mode="json") if rollout is not None else {},
        }
    )


__all__ = ("TripletExtraction", "build_completed_rollout", "extract_triplets")
