"""Each model call of agl-server's triplet view paired with its raw ``model_request`` event.

The triplet view trims a call to its token ids (and the registration that served it), so what else
training needs of a call is read from its raw event: its images (:mod:`agl_rollout.images`) and
the LoRA adapter vLLM answered with (:func:`served_adapter_versions`) and the endpoint that served
it (:func:`served_endpoints`). The triplet view trims and
drops superseded calls but keeps the raw events' order and timestamps, so each trimmed call is
paired with the next raw call that has its timestamp and prompt ids.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from agl_types import Event

logger = logging.getLogger("agl_rollout.raw_calls")

MODEL_REQUEST = "model_request"


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


def raw_call_per_triplet_call(
    triplet_events: Sequence[Event], raw_events: Sequence[Event]
) -> list[Event] | None:
    """For each ``model_request`` of the triplet view, its raw event.

    None, with a warning, when a trimmed call has no raw event left with its timestamp and prompt
    ids: the two views then disagree, and guessing would give a call another call's data.
    """
    raw = [event for event in raw_events if event.event_type == MODEL_REQUEST]
    paired: list[Event] = []
    position = 0
    for index, event in enumerate(e for e in triplet_events if e.event_type == MODEL_REQUEST):
        while position < len(raw) and not _same_call(raw[position], event):
            position += 1
        if position == len(raw):
            logger.warning(
                "rollout %s: model call %d of the triplet view has no raw model_request event with its "
                "timestamp and prompt ids; what only the raw events hold is left out",
                event.rollout_id,
                index,
            )
            return None
        paired.append(raw[position])
        position += 1
    return paired


def served_adapter_versions(raw_calls: Sequence[Event], adapter_prefix: str) -> list[int | None]:
    """For each raw call, ``N`` when vLLM answered it as the adapter ``<adapter_prefix><N>`` (the
    response's ``model``), else None: the weight version that served the call, whatever the
    registration the gateway recorded said."""
    pattern = re.compile(re.escape(adapter_prefix) + r"(\d+)")
    versions: list[int | None] = []
    for call in raw_calls:
        response = call.data.get("response")
        model = response.get("model") if isinstance(response, dict) else None
        match = pattern.fullmatch(model) if isinstance(model, str) else None
        versions.append(int(match.group(1)) if match else None)
    return versions


def served_endpoints(raw_calls: Sequence[Event]) -> list[str | None]:
    """For each raw call, the endpoint the gateway sent it to (its ``server.endpoint``), else None."""
    endpoints: list[str | None] = []
    for call in raw_calls:
        server = call.data.get("server")
        endpoint = server.get("endpoint") if isinstance(server, dict) else None
        endpoints.append(endpoint if isinstance(endpoint, str) else None)
    return endpoints


__all__ = ("MODEL_REQUEST", "raw_call_per_triplet_call", "served_adapter_versions", "served_endpoints")
