"""What an agent of the local stack sees: its rollout and a model reached through the gateway.

Agents call the model only through agl-server's proxy,
``{server}/proxy/rollout/{rid}/attempt/{aid}/mode/{train|val}/openai/v1/completions``, which
records each call as a ``model_request`` event (prompt and response token ids, log-probs in
train mode). Prompts are lists of token ids, so a later turn can extend an earlier turn's
prompt + response exactly and the adapter can merge the turns into one trajectory.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

DEFAULT_MAX_PAUSE_WAIT_SECONDS = 600.0


def proxy_base_url(server_url: str, rollout_id: str, attempt_id: str, mode: str) -> str:
    """The OpenAI base URL of one rollout attempt on the gateway (what agents get as
    ``AGL_OPENAI_BASE_URL`` from the controller)."""
    if mode not in ("train", "val"):
        raise ValueError(f"mode={mode!r} is not a gateway mode; use 'train' or 'val'")
    return f"{server_url.rstrip('/')}/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}/openai/v1"


@dataclass(frozen=True)
class Completion:
    """One model call: ``token_ids`` and ``logprobs`` have shape ``[n_generated]``; logprobs are
    None in val mode (the gateway asks for them in train mode only)."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    text: str
    finish_reason: str | None


class CompletionModel(Protocol):
    """What agents call: a completions endpoint taking token-id prompts."""

    def complete(self, prompt_ids: Sequence[int], max_tokens: int, **params: Any) -> Completion: ...


class GatewayModel:
    """The completions endpoint of one rollout, through the gateway.

    A paused gateway answers 429 with ``Retry-After``; the call then sleeps that long and retries,
    for at most ``max_pause_wait`` seconds in total, and gives up at once when ``stopping`` is set
    (the runner is shutting down: a run's last pause is never lifted, so waiting it out only
    delays the exit).
    """

    def __init__(
        self,
        http: httpx.Client,
        base_url: str,
        max_pause_wait: float = DEFAULT_MAX_PAUSE_WAIT_SECONDS,
        stopping: threading.Event | None = None,
    ) -> None:
        self.http = http
        self.base_url = base_url
        self.max_pause_wait = max_pause_wait
        self.stopping = stopping or threading.Event()

    def complete(self, prompt_ids: Sequence[int], max_tokens: int, **params: Any) -> Completion:
        """Generate up to ``max_tokens`` tokens after ``prompt_ids``."""
        body = {"prompt": list(prompt_ids), "max_tokens": max_tokens, "return_token_ids": True, **params}
        waited = 0.0
        while True:
            response = self.http.post(f"{self.base_url}/completions", json=body)
            if response.status_code != 429:
                break
            delay = _retry_after(response)
            if waited + delay > self.max_pause_wait:
                raise TimeoutError(
                    f"the gateway stayed paused for more than max_pause_wait={self.max_pause_wait:.0f} s "
                    f"({response.text[:200]}); raise max_pause_wait or check the trainer"
                )
            if self.stopping.wait(delay):
                raise RunnerStoppedError("the local runner stopped while the gateway was paused")
            waited += delay
        response.raise_for_status()
        return _parse_completion(list(prompt_ids), response.json())


class RunnerStoppedError(RuntimeError):
    """A model call abandoned because the runner that owns the agent is stopping."""


@dataclass(frozen=True)
class AgentContext:
    """Everything an agent gets for one rollout."""

    rollout_id: str
    input: Any
    is_train: bool
    model: CompletionModel
    metadata: dict[str, Any] = field(default_factory=dict[str, Any])


Agent = Callable[[AgentContext], float]
"""An agent runs one rollout and returns its final reward."""


def _retry_after(response: httpx.Response) -> float:
    try:
        return max(0.1, float(response.headers.get("Retry-After", "1")))
    except ValueError:
        return 1.0


def _parse_completion(prompt_ids: list[int], body: dict[str, Any]) -> Completion:
    choice = body["choices"][0]
    token_ids = choice.get("token_ids")
    if not isinstance(token_ids, list):
        raise ValueError(
            "the model server returned no choices[0].token_ids; it must support return_token_ids (vLLM >= 0.10)"
        )
    logprobs = choice.get("logprobs")
    token_logprobs = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    return Completion(
        prompt_ids=prompt_ids,
        token_ids=[int(token) for token in token_ids],
        logprobs=[float(value) for value in token_logprobs] if isinstance(token_logprobs, list) else None,
        text=str(choice.get("text", "")),
        finish_reason=choice.get("finish_reason"),
    )
