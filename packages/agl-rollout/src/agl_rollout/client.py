"""A synchronous httpx client of agl-server 1.0.x, with timeouts on every call.

Calls that are safe to repeat (every GET and DELETE, rollout creation with client-chosen
ids, model registration, pause and resume) are retried with bounded backoff on transport
errors, timeouts and 5xx answers. Calls that append or transition (posting an event,
patching a state) are retried only when the connection could not even be opened, since a
lost answer there could mean the server already acted. 4xx answers are never retried and
raise :class:`AglHTTPError` quoting the server's ``detail``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import httpx

from agl_rollout.errors import AglHTTPError, AglUnavailableError
from agl_rollout.retry import RetryPolicy
from agl_types import (
    Event,
    EventCreate,
    ModelRegistration,
    PauseRequest,
    PauseState,
    Rollout,
    RolloutCreate,
    RolloutDetail,
    RolloutMetadata,
    RolloutState,
    RolloutStatusPatch,
    TerminalRolloutsPage,
)

logger = logging.getLogger("agl_rollout.client")

PAUSE_TIMEOUT_S = 300.0
"""The pause call waits this long: a server saturated with in-flight proxy calls answers slowly."""

RetryMode = Literal["idempotent", "connect-only"]


def _detail(response: httpx.Response) -> object:
    try:
        body = response.json()
    except ValueError:
        return response.text or response.reason_phrase
    return body.get("detail", body) if isinstance(body, dict) else body


class AglClient:
    """Client of one agl-server; ``request_count`` counts every HTTP try (for benchmarks).

    ``key`` is sent as ``Authorization: Bearer <key>`` when non-empty, as the server expects.
    ``run_id`` goes into the metadata of every rollout this client creates: a run resumed from a
    checkpoint finds by it the rollouts its dead predecessor left (:mod:`agl_rollout.orphans`).
    """

    def __init__(
        self,
        base_url: str,
        key: str | None = None,
        *,
        timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
        run_id: str | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self.run_id = run_id
        self.request_count = 0
        self._registered: set[tuple[str, str]] | None = None
        self._models: list[ModelRegistration] | None = None
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout_s, transport=transport
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AglClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def create_rollouts(self, requests: Sequence[RolloutCreate]) -> list[Rollout]:
        """Create rollouts in one batch; every request must carry its ``rollout_id``.

        Pre-chosen ids make the call idempotent: a retry after a lost answer returns the
        rollouts the first try created instead of creating them twice.
        """
        missing = [i for i, r in enumerate(requests) if not r.rollout_id]
        if missing:
            raise ValueError(
                f"requests {missing[:5]} have no rollout_id; choose ids before creating so retries "
                "cannot create duplicates"
            )
        if not requests:
            return []
        if self.run_id is not None:
            requests = [_with_run_id(r, self.run_id) for r in requests]
        body = [r.to_wire() for r in requests]
        data = self._json("POST", "/api/rollouts", json=body, mode="idempotent")
        rollouts = [Rollout.model_validate(item) for item in data]
        if len(rollouts) != len(requests):
            raise AglHTTPError(
                "POST",
                self._url("/api/rollouts"),
                201,
                f"returned {len(rollouts)} of {len(requests)} rollouts",
            )
        return rollouts

    def get_rollout(self, rollout_id: str) -> RolloutDetail:
        return RolloutDetail.model_validate(self._json("GET", f"/api/rollouts/{rollout_id}"))

    def list_rollouts(self, states: Iterable[RolloutState], *, limit: int = 500) -> list[Rollout]:
        """Rollouts in any of ``states``, in insertion order, at most ``limit`` of them."""
        params = [("state_in", RolloutState(s).value) for s in states] + [("limit", str(limit))]
        return [Rollout.model_validate(r) for r in self._json("GET", "/api/rollouts", params=params)]

    def terminal_page(self, after: int = 0, *, limit: int = 1000) -> TerminalRolloutsPage:
        """Rollouts that turned terminal since position ``after`` of the server's completion log."""
        params = {"after": str(after), "limit": str(limit)}
        return TerminalRolloutsPage.model_validate(self._json("GET", "/api/rollouts/terminal", params=params))

    def patch_rollout_status(self, rollout_id: str, patch: RolloutStatusPatch) -> Rollout:
        # Only the fields the caller set: an explicit ``"state": null`` is a 409 on the server.
        body = {"status": patch.model_dump(mode="json", exclude_unset=True)}
        return Rollout.model_validate(
            self._json("PATCH", f"/api/rollouts/{rollout_id}", json=body, mode="connect-only")
        )

    def delete_rollout(self, rollout_id: str) -> None:
        """Delete a rollout and its events; deleting an unknown id is a no-op on the server."""
        self._send("DELETE", f"/api/rollouts/{rollout_id}")

    def get_events(
        self,
        rollout_id: str,
        *,
        triplet: bool = False,
        event_type: str | None = None,
        include_routed_experts: bool | None = None,
    ) -> list[Event]:
        """Events of the visible attempt; ``triplet=True`` asks for the trimmed RL channel.

        ``include_routed_experts=None`` leaves the MoE routes to the server's default (included);
        servers before agentlightning 1.0.2 have none and ignore the parameter.
        """
        params: dict[str, str] = {}
        if triplet:
            params["format"] = "triplet"
        if event_type is not None:
            params["event_type"] = event_type
        if include_routed_experts is not None:
            params["include_routed_experts"] = str(include_routed_experts).lower()
        data = self._json("GET", f"/api/rollouts/{rollout_id}/events", params=params)
        return [Event.model_validate(e) for e in data]

    def post_event(self, rollout_id: str, attempt_id: str, event: EventCreate) -> Event:
        data = self._json(
            "POST",
            f"/api/rollouts/{rollout_id}/attempt/{attempt_id}/events",
            json=event.model_dump(mode="json"),
            mode="connect-only",
        )
        return Event.model_validate(data)

    def delete_models(self) -> None:
        """Remove every registered model endpoint (of every model name)."""
        self._send("DELETE", "/api/models")
        self._registered = set()
        self._models = None

    def register_models(self, models: Sequence[ModelRegistration]) -> list[ModelRegistration]:
        """Make ``models`` the gateway's endpoints, without a gap while nothing is removed.

        The server upserts by (model, endpoint) and can only delete all endpoints at once. So
        when every endpoint this client registered last is still in ``models`` (a new weight
        version, an added replica) one POST replaces them in place and in-flight agents never
        see a missing model. Otherwise (an endpoint is gone, or this client's first call, which
        cannot know what an earlier run left behind) all are deleted first, and model calls in
        that one round trip get 503 "No servers available".
        """
        keys = {(m.model, m.endpoint) for m in models}
        if self._registered is None or not self._registered <= keys:
            self.delete_models()
        body = [m.model_dump(mode="json") for m in models]
        data = self._json("POST", "/api/models", json=body)
        self._registered = keys
        self._models = list(models)
        return [ModelRegistration.model_validate(m) for m in data]

    def restore_models(self) -> None:
        """Register this client's last models again (a restarted server has none); no-op before any."""
        if self._models is not None:
            self.register_models(self._models)

    def pause(self, reason: str | None = None, *, retry_after_seconds: int = 5) -> PauseState:
        body = PauseRequest(retry_after_seconds=retry_after_seconds, reason=reason).model_dump(mode="json")
        data = self._json("POST", "/proxy/pause", json=body, timeout_s=PAUSE_TIMEOUT_S)
        return PauseState.model_validate(data)

    def resume(self) -> PauseState:
        return PauseState.model_validate(self._json("POST", "/proxy/resume"))

    def proxy_state(self) -> PauseState:
        return PauseState.model_validate(self._json("GET", "/proxy/state"))

    def _url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    def _json(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Any = None,
        mode: RetryMode = "idempotent",
        timeout_s: float | None = None,
    ) -> Any:
        return self._send(method, path, json=json, params=params, mode=mode, timeout_s=timeout_s).json()

    def _send(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Any = None,
        mode: RetryMode = "idempotent",
        timeout_s: float | None = None,
    ) -> httpx.Response:
        started = time.monotonic()
        delays = self.retry.delays()
        attempt = 0
        while True:
            attempt += 1
            self.request_count += 1
            try:
                response = self._http.request(
                    method,
                    path,
                    json=json,
                    params=params,
                    timeout=timeout_s if timeout_s is not None else httpx.USE_CLIENT_DEFAULT,
                )
            except httpx.TransportError as exc:
                retryable = mode == "idempotent" or isinstance(exc, httpx.ConnectError)
                failure: httpx.TransportError | httpx.Response = exc
            else:
                if response.status_code < 400:
                    return response
                if response.status_code < 500:
                    raise AglHTTPError(method, self._url(path), response.status_code, _detail(response))
                retryable = mode == "idempotent"
                failure = response
            if not retryable or attempt >= self.retry.max_attempts:
                delay = None
            elif isinstance(failure, DROPPED_CONNECTION_ERRORS):
                delay = 0.0  # the connection died under the call, not the server: a new one works at once
            else:
                delay = next(delays, None)
            elapsed = time.monotonic() - started
            if delay is None or elapsed + delay > self.retry.deadline_s:
                raise self._give_up(method, path, failure, attempt, elapsed)
            logger.warning(
                "agl-server call failed, retrying method=%s path=%s attempt=%d error=%s retry_in_s=%.2f",
                method,
                path,
                attempt,
                _describe(failure),
                delay,
            )
            time.sleep(delay)

    def _give_up(
        self,
        method: str,
        path: str,
        failure: httpx.TransportError | httpx.Response,
        attempts: int,
        elapsed: float,
    ) -> Exception:
        url = self._url(path)
        if isinstance(failure, httpx.Response):
            return AglHTTPError(method, url, failure.status_code, _detail(failure))
        return AglUnavailableError(
            f"{method} {url} failed after {attempts} tr{'y' if attempts == 1 else 'ies'} over {elapsed:.1f} s: "
            f"{_describe(failure)}; check that agl-server is running at {self.base_url} "
            "(or raise RetryPolicy.deadline_s for a slow restart)"
        )


DROPPED_CONNECTION_ERRORS = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
"""Transport errors of a connection that was reset or closed under a call (not a refused connect,
not a timeout): such a call is retried at once on a new connection, with no back-off (a server
that is really gone refuses the new connection, and that error backs off)."""


def _with_run_id(request: RolloutCreate, run_id: str) -> RolloutCreate:
    metadata = (request.metadata or RolloutMetadata()).model_copy(update={"run_id": run_id})
    return request.model_copy(update={"metadata": metadata})


def _describe(failure: httpx.TransportError | httpx.Response) -> str:
    if isinstance(failure, httpx.Response):
        return f"HTTP {failure.status_code}"
    return f"{type(failure).__name__}: {failure}" if str(failure) else type(failure).__name__


__all__ = ("PAUSE_TIMEOUT_S", "AglClient")
