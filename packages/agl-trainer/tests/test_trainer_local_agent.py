"""The agent's view of the gateway: URLs, completions parsing and waiting out a paused gateway."""

from __future__ import annotations

import json

import httpx
import pytest

from agl_trainer.local import GatewayModel, proxy_base_url

_BODY = {
    "choices": [
        {
            "text": "12",
            "token_ids": [7, 8],
            "logprobs": {"token_logprobs": [-0.5, -0.25]},
            "finish_reason": "length",
        }
    ]
}


def test_proxy_base_url_matches_the_gateway_route() -> None:
    assert (
        proxy_base_url("http://127.0.0.1:9/", "r1", "0", "train")
        == "http://127.0.0.1:9/proxy/rollout/r1/attempt/0/mode/train/openai/v1"
    )


def test_proxy_base_url_refuses_unknown_mode() -> None:
    with pytest.raises(ValueError, match="mode='test' is not a gateway mode"):
        proxy_base_url("http://h", "r", "0", "test")


def test_complete_sends_token_ids_and_parses_ids_and_logprobs() -> None:
    seen: list[dict[str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=_BODY)

    model = GatewayModel(httpx.Client(transport=httpx.MockTransport(handler)), "http://g/v1")
    completion = model.complete([1, 2, 3], max_tokens=2)
    assert seen == [{"prompt": [1, 2, 3], "max_tokens": 2, "return_token_ids": True}]
    assert completion.token_ids == [7, 8]
    assert completion.logprobs == [-0.5, -0.25]
    assert completion.prompt_ids == [1, 2, 3]
    assert completion.finish_reason == "length"


def test_complete_without_logprobs_gives_none() -> None:
    body = {"choices": [{"text": "", "token_ids": [4], "logprobs": None, "finish_reason": "stop"}]}
    client = httpx.Client(transport=httpx.MockTransport(lambda _r: httpx.Response(200, json=body)))
    assert GatewayModel(client, "http://g/v1").complete([1], max_tokens=1).logprobs is None


def test_complete_retries_after_429_then_succeeds() -> None:
    answers = iter(
        [httpx.Response(429, headers={"Retry-After": "0"}, json={"error": "gateway paused"})] * 2
        + [httpx.Response(200, json=_BODY)]
    )
    client = httpx.Client(transport=httpx.MockTransport(lambda _r: next(answers)))
    assert GatewayModel(client, "http://g/v1").complete([1], max_tokens=2).token_ids == [7, 8]


def test_complete_gives_up_when_pause_outlasts_max_pause_wait() -> None:
    paused = httpx.Response(429, headers={"Retry-After": "5"}, json={"error": "gateway paused"})
    client = httpx.Client(transport=httpx.MockTransport(lambda _r: paused))
    with pytest.raises(TimeoutError, match=r"paused for more than max_pause_wait=1 s"):
        GatewayModel(client, "http://g/v1", max_pause_wait=1.0).complete([1], max_tokens=1)


def test_complete_raises_on_upstream_error_status() -> None:
    client = httpx.Client(transport=httpx.MockTransport(lambda _r: httpx.Response(503, json={"detail": "x"})))
    with pytest.raises(httpx.HTTPStatusError):
        GatewayModel(client, "http://g/v1").complete([1], max_tokens=1)


def test_complete_without_token_ids_names_the_missing_field() -> None:
    body = {"choices": [{"text": "a"}]}
    client = httpx.Client(transport=httpx.MockTransport(lambda _r: httpx.Response(200, json=body)))
    with pytest.raises(ValueError, match=r"no choices\[0\].token_ids"):
        GatewayModel(client, "http://g/v1").complete([1], max_tokens=1)
