"""The few agl-server calls the local stack makes (the trainer's own client lives in agl-rollout).

The local runner plays the controller's role: it lists queuing rollouts, claims them, posts the
agent's reward and finishes them. Bodies follow ``agentlightning.server.routes`` 1.0.x.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import httpx

from agl_trainer.local.errors import ServerApiError

_TRANSPORT_ATTEMPTS = 5


class AglServerApi:
    """Synchronous, thread-safe client of one agl-server."""

    def __init__(self, url: str, key: str, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.key = key
        self.http = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=timeout
        )

    def list_rollouts(self, states: Sequence[str], limit: int = 500) -> list[dict[str, Any]]:
        """Rollouts whose state is in ``states``, in creation order."""
        params = [("state_in", state) for state in states] + [("limit", str(limit))]
        return self._expect((200,), "GET", "/api/rollouts", params=params).json()

    def patch_status(self, rollout_id: str, **status: str) -> dict[str, Any] | None:
        """Patch the rollout's status; None when the server refuses the transition (409) or the
        rollout is gone (404), which means another runner or the trainer got there first."""
        response = self._request("PATCH", f"/api/rollouts/{rollout_id}", json={"status": status})
        if response.status_code in (404, 409):
            return None
        self._check(response, (200,))
        return response.json()

    def post_event(self, rollout_id: str, attempt_id: str, event_type: str, data: Mapping[str, Any]) -> None:
        """Append one event to the rollout's attempt."""
        path = f"/api/rollouts/{rollout_id}/attempt/{attempt_id}/events"
        self._expect((200,), "POST", path, json={"event_type": event_type, "data": dict(data)})

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> AglServerApi:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _expect(self, codes: tuple[int, ...], method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = self._request(method, path, **kwargs)
        self._check(response, codes)
        return response

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        attempt = 0
        while True:
            try:
                return self.http.request(method, path, **kwargs)
            except httpx.TransportError:
                attempt += 1
                if attempt >= _TRANSPORT_ATTEMPTS:
                    raise
                time.sleep(0.2 * 2**attempt)

    @staticmethod
    def _check(response: httpx.Response, codes: tuple[int, ...]) -> None:
        if response.status_code not in codes:
            request = response.request
            raise ServerApiError(
                f"{request.method} {request.url.path} answered HTTP {response.status_code} "
                f"(expected {codes}): {response.text[:1000]}"
            )
