"""Test agents that play the controller and the agent through agl-server's public API.

:class:`FakeAgents` polls queued rollouts, claims each by PATCHing it RUNNING (the server
serialises transitions, so a rollout is claimed once however many pools run), then, on a
worker thread, waits the behaviour's delay, posts ``model_request`` events shaped as the
gateway proxy records them plus a ``reward`` event, and PATCHes the final state. What each
rollout does is an :class:`AgentBehaviour`, fixed or chosen per rollout from its JSON.

A pool claims only its own test's rollouts: those the server created at or after ``since``
(by default the moment the pool was made), so a rollout another test left on a shared server
is never touched. Anything that goes wrong in an agent (an exception in the behaviour, an
HTTP error) is recorded with its traceback, fails the rollout on the server at once (so the
wait ends instead of timing out) and is raised as :class:`FakeAgentError` when the pool stops,
which fails the test that used it; pass ``check_errors=False`` where a test breaks the server
on purpose.

Only httpx and the standard library, so every package's tests (and the trainer's) can use it::

    with FakeAgents(server.url, behaviour=lambda r: AgentBehaviour(reward=float(r["input"]["x"]))):
        manager.enqueue_and_wait_until_completed(batch, is_train=True)
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from agl_testing.agl_server import TEST_KEY, TEST_MODEL_NAME

logger = logging.getLogger("agl_testing.agents")

Outcome = Literal["succeeded", "failed", "never_finish", "never_start"]
Malformed = Literal["error_status", "no_response_tokens", "bad_log_probs", "non_numeric_reward"]


@dataclass(frozen=True)
class TurnImage:
    """An image a fake agent adds to its conversation: its URL and the prompt ids it expands to."""

    url: str
    placeholder: tuple[int, ...] = ()


@dataclass(frozen=True)
class AgentBehaviour:
    """What one fake agent does with its rollout.

    ``turns`` model calls, each prompt extending the previous context (as a multi-turn agent's
    would); ``reward=None`` posts no reward; ``malformed`` adds one unusable event of each kind
    listed (on top of the valid ones); ``token_shift`` offsets the response ids (so rollouts of
    one group can differ); ``never_finish`` leaves the rollout RUNNING and ``never_start`` leaves
    it QUEUING; ``weight_version`` is what the fake proxy records; ``wait_for``, when given, holds
    the rollout RUNNING until the test sets that event (after ``delay_s``; an event not set within
    120 s is an agent error), so a test orders things by events rather than by sleeps.
    ``routed_experts`` makes each call carry MoE routes, as the gateway records them with
    ``include_routed_experts``: an opaque payload ``routes-<turn>`` (the server does not decode it).
    ``via_gateway`` makes each turn a real completions call through the gateway (a prompt of token
    ids; the upstream the test registered answers): the gateway then records the call, with the
    weight version of the registration that served it, so no version is written by the agent
    (``weight_version``, ``malformed``, ``routed_experts`` and ``images`` then stay unset). A paused
    gateway's ``429`` is retried after its ``Retry-After``, capped at 0.2 s.
    ``images``, one per turn from the first, make each call a chat request whose messages carry the
    images of every turn so far; each image's ``placeholder`` ids join the context before its turn's
    call (as a chat template expands them). The first call is then recorded twice, as a retry with
    the same prompt ids would be: first without images (the triplet view keeps the second).
    """

    delay_s: float = 0.0
    turns: int = 1
    outcome: Outcome = "succeeded"
    reward: float | None = 1.0
    malformed: tuple[Malformed, ...] = ()
    weight_version: int = 0
    token_shift: int = 0
    wait_for: threading.Event | None = None
    routed_experts: bool = False
    images: tuple[TurnImage, ...] = ()
    via_gateway: bool = False

    def __post_init__(self) -> None:
        if self.via_gateway and (self.weight_version or self.malformed or self.routed_experts or self.images):
            raise ValueError(
                "an agent calling through the gateway records nothing itself: drop weight_version, ..."
            )


_WAIT_FOR_LIMIT_S = 120.0

Behaviour = AgentBehaviour | Callable[[dict[str, Any]], AgentBehaviour]


def model_request_data(
    prompt_ids: list[int],
    response_ids: list[int],
    *,
    log_probs: list[float] | None = None,
    version: int = 0,
    http_status: int = 200,
    model: str = TEST_MODEL_NAME,
    routed_experts: str | None = None,
    messages: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A ``model_request`` payload in the shape the gateway proxy records for a completions call
    (a chat call when ``messages`` are given)."""
    lps = log_probs if log_probs is not None else [-0.5] * len(response_ids)
    ok = http_status < 400
    request = (
        {"model": model, "prompt": prompt_ids} if messages is None else {"model": model, "messages": messages}
    )
    return {
        "model": model,
        "model_version": version,
        "request": request,
        "response": {
            "choices": [
                {
                    "prompt_token_ids": prompt_ids,
                    "token_ids": response_ids,
                    "logprobs": {"token_logprobs": lps},
                    "finish_reason": "stop",
                }
            ]
        },
        "server": {"model": model, "endpoint": "http://127.0.0.1:9/v1", "version": version},
        "latency_ms": 1.0,
        "http_status": http_status,
        "status": "ok" if ok else "error",
        "retry_count": 0,
        "routed_experts": routed_experts,
    }


def _malformed_event(kind: Malformed, k: int, version: int) -> tuple[str, dict[str, Any]]:
    prompt = [900 + k, 901 + k]  # unique prompts: the triplet channel collapses identical ones
    if kind == "error_status":
        return "model_request", model_request_data(prompt, [5, 6], version=version, http_status=500)
    if kind == "no_response_tokens":
        return "model_request", model_request_data(prompt, [], version=version)
    if kind == "bad_log_probs":
        return "model_request", model_request_data(prompt, [5, 6, 7], log_probs=[-0.1], version=version)
    return "reward", {"value": "high"}


def _chat_messages(images: Sequence[TurnImage]) -> list[dict[str, Any]]:
    """A conversation of one user message per image (with some text), answered in between."""
    messages: list[dict[str, Any]] = []
    for k, image in enumerate(images):
        if k:
            messages.append({"role": "assistant", "content": f"saw {k - 1}"})
        parts = [
            {"type": "text", "text": f"look {k}"},
            {"type": "image_url", "image_url": {"url": image.url}},
        ]
        messages.append({"role": "user", "content": parts})
    return messages


class FakeAgentError(AssertionError):
    """Something went wrong inside a fake agent; the message holds every traceback."""


@dataclass
class AgentStats:
    claimed: list[str] = field(default_factory=list[str])
    finished: list[str] = field(default_factory=list[str])
    deleted: list[str] = field(default_factory=list[str])
    """Rollouts deleted on the server while their agent worked (the trainer cancels what is in
    flight at the end of a run): a real agent then gets 404s too, and it is no agent error."""
    errors: list[str] = field(default_factory=list[str])


class FakeAgents:
    """A pool of fake agents working on one server until :meth:`stop` (or the ``with`` block ends)."""

    def __init__(
        self,
        base_url: str,
        *,
        behaviour: Behaviour | None = None,
        key: str = TEST_KEY,
        workers: int = 8,
        poll_interval_s: float = 0.02,
        since: float | None = None,
        check_errors: bool = True,
    ) -> None:
        self._behaviour: Behaviour = behaviour or AgentBehaviour()
        # The server stamps ``created_at`` with time.time() on this same machine.
        self.since = time.time() if since is None else since
        self._check_errors = check_errors
        self._http = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=10.0)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fake-agent")
        self._poll_interval_s = poll_interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._dispatch, name="fake-controller", daemon=True)
        self._lock = threading.Lock()
        self._left_queued: set[str] = set()
        self.stats = AgentStats()

    def start(self) -> FakeAgents:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop claiming, let the claimed rollouts' agents finish, and raise what went wrong."""
        self._shutdown()
        if self._check_errors and self.stats.errors:
            raise FakeAgentError(self._error_report())

    def _shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._http.close()

    def _error_report(self) -> str:
        return f"{len(self.stats.errors)} fake agent error(s):\n" + "\n".join(self.stats.errors)

    def __enter__(self) -> FakeAgents:
        return self.start()

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.stop()
            return
        # The test already failed: keep its exception, with the agents' tracebacks attached.
        self._shutdown()
        if self.stats.errors:
            exc.add_note(self._error_report())

    def _behaviour_for(self, rollout: dict[str, Any]) -> AgentBehaviour:
        return self._behaviour if isinstance(self._behaviour, AgentBehaviour) else self._behaviour(rollout)

    def _dispatch(self) -> None:
        while not self._stop.is_set():
            try:
                self._claim_queued()
            except Exception:
                self._record_error("poll")
            self._stop.wait(self._poll_interval_s)

    def _claim_queued(self) -> None:
        reply = self._http.get("/api/rollouts", params={"state_in": "queuing", "limit": 1000})
        reply.raise_for_status()
        for rollout in reply.json():
            rid = rollout["rollout_id"]
            if rid in self._left_queued or rollout["status"]["created_at"] < self.since:
                continue
            try:
                behaviour = self._behaviour_for(rollout)
            except Exception:
                self._record_error(f"{rid}: behaviour")
                self._left_queued.add(rid)
                self._fail_on_server(rid, "the fake agent's behaviour raised")
                continue
            if behaviour.outcome == "never_start":
                self._left_queued.add(rid)
                continue
            claim = self._http.patch(f"/api/rollouts/{rid}", json={"status": {"state": "running"}})
            if claim.status_code != 200:
                continue  # someone else claimed it, or it was deleted meanwhile
            with self._lock:
                self.stats.claimed.append(rid)
            self._pool.submit(self._run, claim.json(), behaviour)

    def _run(self, rollout: dict[str, Any], behaviour: AgentBehaviour) -> None:
        rid = rollout["rollout_id"]
        try:
            if self._stop.wait(behaviour.delay_s) or behaviour.outcome == "never_finish":
                return
            if behaviour.wait_for is not None and not self._wait_for(behaviour.wait_for):
                return
            if behaviour.via_gateway:
                self._call_through_gateway(rid, behaviour.turns)
                if behaviour.reward is not None:
                    self._post(rid, "reward", {"value": behaviour.reward, "source": "agent"})
            else:
                for event_type, data in self._events(behaviour):
                    self._post(rid, event_type, data)
            final = "succeeded" if behaviour.outcome == "succeeded" else "failed"
            patch: dict[str, Any] = {"state": final}
            if final == "failed":
                patch["error_message"] = "fake agent failed on purpose"
            self._http.patch(f"/api/rollouts/{rid}", json={"status": patch}).raise_for_status()
            with self._lock:
                self.stats.finished.append(rid)
        except httpx.HTTPStatusError as error:
            if error.response.status_code == 404:
                with self._lock:
                    self.stats.deleted.append(rid)
                return
            self._record_error(rid)
            self._fail_on_server(rid, "the fake agent raised")
        except Exception:
            self._record_error(rid)
            self._fail_on_server(rid, "the fake agent raised")

    def _call_through_gateway(self, rid: str, turns: int) -> None:
        """``turns`` completions calls on the rollout's gateway URL, each prompt the context so far
        plus an observation token."""
        url = f"/proxy/rollout/{rid}/attempt/0/mode/train/openai/v1/completions"
        context = [1, 2, 3]
        for turn in range(turns):
            while True:
                reply = self._http.post(
                    url, json={"model": TEST_MODEL_NAME, "prompt": context, "max_tokens": 2}
                )
                if reply.status_code != 429 or self._stop.is_set():
                    break
                self._stop.wait(min(float(reply.headers.get("retry-after", "1")), 0.2))
            reply.raise_for_status()
            context = [*context, *reply.json()["choices"][0]["token_ids"], 30 + turn]

    def _wait_for(self, event: threading.Event) -> bool:
        """Wait for the test's event; ``False`` when the pool stops first. Raises after the limit."""
        deadline = time.monotonic() + _WAIT_FOR_LIMIT_S
        while not event.wait(0.05):
            if self._stop.is_set():
                return False
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the test did not set the agent's wait_for event within {_WAIT_FOR_LIMIT_S} s"
                )
        return True

    def _events(self, behaviour: AgentBehaviour) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        context = [1, 2, 3]
        for turn in range(behaviour.turns):
            response = [10 + turn + behaviour.token_shift, 20 + turn + behaviour.token_shift]
            shown = behaviour.images[: turn + 1]
            if turn < len(behaviour.images):
                context += behaviour.images[turn].placeholder
            attempts = [(), shown] if behaviour.images and turn == 0 else [shown]
            events.extend(
                (
                    "model_request",
                    model_request_data(
                        list(context),
                        response,
                        version=behaviour.weight_version,
                        routed_experts=f"routes-{turn}" if behaviour.routed_experts else None,
                        messages=_chat_messages(attempt) if behaviour.images else None,
                    ),
                )
                for attempt in attempts
            )
            context = [*context, *response, 30 + turn]
        events.extend(
            _malformed_event(kind, k, behaviour.weight_version) for k, kind in enumerate(behaviour.malformed)
        )
        if behaviour.reward is not None:
            events.append(("reward", {"value": behaviour.reward, "source": "agent"}))
        return events

    def _post(self, rid: str, event_type: str, data: dict[str, Any]) -> None:
        reply = self._http.post(
            f"/api/rollouts/{rid}/attempt/0/events", json={"event_type": event_type, "data": data}
        )
        reply.raise_for_status()

    def _fail_on_server(self, rid: str, message: str) -> None:
        """End the rollout so the test's wait returns now rather than at its timeout."""
        # A server that is gone makes the wait fail on its own.
        with contextlib.suppress(httpx.HTTPError):
            self._http.patch(
                f"/api/rollouts/{rid}", json={"status": {"state": "failed", "error_message": message}}
            )

    def _record_error(self, where: str) -> None:
        """Record the exception being handled, with its traceback."""
        message = f"{where}:\n{traceback.format_exc()}"
        logger.debug("fake agent error: %s", message)
        with self._lock:
            self.stats.errors.append(message)


__all__ = (
    "AgentBehaviour",
    "AgentStats",
    "Behaviour",
    "FakeAgentError",
    "FakeAgents",
    "Malformed",
    "Outcome",
    "model_request_data",
)
