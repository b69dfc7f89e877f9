"""The image URLs each model call of a rollout saw, for training vision-language models.

agl-server's triplet view trims a ``model_request`` event to its token ids, so a call's images are
read from the raw event's request messages (OpenAI chat content parts of type ``image_url``). The
triplet view trims and drops superseded calls but keeps the raw events' order and timestamps, so
each trimmed call is paired with the next raw call that has its timestamp.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from agl_types import Event

logger = logging.getLogger("agl_rollout.images")

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


def _raw_prompt_ids(data: dict[str, Any]) -> Any:
    """The prompt ids the server's triplet view reads from a raw call's response."""
    response = data.get("response")
    if not isinstance(response, dict):
        return None
    choices = response.get("choices") or [{}]
    return response.get("prompt_token_ids") or (choices[0] or {}).get("prompt_token_ids")


def _same_call(raw: Event, trimmed: Event) -> bool:
    if raw.timestamp != trimmed.timestamp:
        return False
    prompt_ids = trimmed.data.get("prompt_token_ids")
    return not prompt_ids or _raw_prompt_ids(raw.data) == prompt_ids


def image_urls_per_call(
    triplet_events: Sequence[Event], raw_events: Sequence[Event]
) -> list[list[str]] | None:
    """For each ``model_request`` of the triplet view, the image URLs of its raw event.

    None, with a warning, when a trimmed call has no raw event left with its timestamp and prompt
    ids: the two views then disagree, and guessing would put images under another call's tokens.
    Without images, such a rollout's rows that hold image tokens are dropped by the adapter.
    """
    raw = [event for event in raw_events if event.event_type == MODEL_REQUEST]
    urls: list[list[str]] = []
    position = 0
    for index, event in enumerate(e for e in triplet_events if e.event_type == MODEL_REQUEST):
        while position < len(raw) and not _same_call(raw[position], event):
            position += 1
        if position == len(raw):
            logger.warning(
                "rollout %s: model call %d of the triplet view has no raw model_request event with its "
                "timestamp and prompt ids; its images are left out",
                event.rollout_id,
                index,
            )
            return None
        urls.append(request_image_urls(raw[position].data.get("request")))
        position += 1
    return urls


__all__ = ("image_urls_per_call", "request_image_urls")
