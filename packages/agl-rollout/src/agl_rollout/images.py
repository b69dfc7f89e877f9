"""The image URLs each model call of a rollout saw, for training vision-language models.

agl-server's triplet view trims a ``model_request`` event to its token ids, so a call's images are
read from the raw event's request messages (OpenAI chat content parts of type ``image_url``),
paired with the trimmed call by :mod:`agl_rollout.raw_calls`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agl_rollout.raw_calls import MODEL_REQUEST, raw_call_per_triplet_call
from agl_types import Event


def _content_parts(content: Any) -> list[Any]:
    if isinstance(content, str):  # some clients send the parts list as JSON text
        try:
            content = json.loads(content)
        except json.JSONDecodeError:
            return []
    return content if isinstance(content, list) else []


def request_image_urls(request: Any) -> list[str]:
    """The ``image_url`` URLs of a recorded chat request's messages, in order of appearance."""
    messages = request.get("messages") if isinstance(request, dict) else None
    urls: list[str] = []
    for message in messages if isinstance(messages, list) else []:
        if not isinstance(message, dict):
            continue
        for part in _content_parts(message.get("content")):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            image = part.get("image_url")
            if isinstance(image, dict) and isinstance(image.get("url"), str):
                urls.append(image["url"])
    return urls


def image_urls_per_call(
    triplet_events: Sequence[Event], raw_events: Sequence[Event]
) -> list[list[str]] | None:
    """For each ``model_request`` of the triplet view, the image URLs of its raw event.

    None when the two views disagree (:func:`agl_rollout.raw_calls.raw_call_per_triplet_call`):
    such a rollout's rows that hold image tokens are then dropped by the adapter.
    """
    paired = raw_call_per_triplet_call(triplet_events, raw_events)
    return None if paired is None else raw_calls_image_urls(paired)


def raw_calls_image_urls(raw_calls: Sequence[Event]) -> list[list[str]]:
    """The image URLs of each raw ``model_request`` event's request."""
    return [request_image_urls(call.data.get("request")) for call in raw_calls]


__all__ = ("MODEL_REQUEST", "image_urls_per_call", "raw_calls_image_urls", "request_image_urls")
