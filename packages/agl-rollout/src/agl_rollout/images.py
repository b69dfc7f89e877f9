"""The image URLs each model call of a rollout saw, for training vision-language models.

agl-server's triplet view trims a ``model_request`` event to its token ids, so a call's images are
read from the raw event's request messages (OpenAI chat content parts of type ``image_url``). The
triplet view trims and drops superseded calls but keeps the raw events' order and timestamps, so
each trimmed call is paired with the next raw call that has its timestamp.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agl_rollout.errors import ImagePairingError
from agl_types import Event

MODEL_REQUEST = "model_request"


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


def image_urls_per_call(triplet_events: Sequence[Event], raw_events: Sequence[Event]) -> list[list[str]]:
    """For each ``model_request`` of the triplet view, the image URLs of its raw event.

    Raises ImagePairingError when a trimmed call has no raw event left with its timestamp: the
    two views then disagree, and guessing would train images under another call's tokens.
    """
    raw = [event for event in raw_events if event.event_type == MODEL_REQUEST]
    urls: list[list[str]] = []
    position = 0
    for index, event in enumerate(e for e in triplet_events if e.event_type == MODEL_REQUEST):
        while position < len(raw) and raw[position].timestamp != event.timestamp:
            position += 1
        if position == len(raw):
            raise ImagePairingError(event.rollout_id, index)
        urls.append(request_image_urls(raw[position].data.get("request")))
        position += 1
    return urls


__all__ = ("image_urls_per_call", "request_image_urls")
