"""A stdlib-only JSON HTTP helper for tests that must run without httpx (agl-types' own venv)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Reply:
    status: int
    body: Any


def call(
    method: str, url: str, *, key: str | None = None, json_body: Any = None, timeout: float = 10.0
) -> Reply:
    """Send one request and return the status and the decoded JSON body (``None`` when empty)."""
    data = None if json_body is None else json.dumps(json_body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            raw = resp.read()
            return Reply(resp.status, json.loads(raw) if raw else None)
    except urllib.error.HTTPError as err:
        raw = err.read()
        return Reply(err.code, json.loads(raw) if raw else None)
