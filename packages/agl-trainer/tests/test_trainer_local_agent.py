"""The agent's view of the gateway: URLs, completions parsing and waiting out a paused gateway."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from agl_rollout import AglClient, model_registrations
from agl_testing.agl_server import TEST_KEY, TEST_MODEL_NAME, AglServerProcess
from agl_testing.fake_upstream import HeldCompletions
from agl_testing.fault_proxy import FaultProxy
from agl_trainer.local import GatewayModel, proxy_base_url
from agl_types import RolloutCreate

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


@pytest.fixture
def paused_gateway(agl_server: AglServerProcess) -> Iterator[tuple[AglClient, str]]:
    """The real gateway, paused, with a model behind it and a rollout to call it for; the
    gateway is resumed and the rollout deleted afterwards."""
    with HeldCompletions() as upstream, AglClient(agl_server.url, TEST_KEY) as client:
        client.register_models(model_registrations(TEST_MODEL_NAME, [upstream.address], version=0))
        [rollout] = client.create_rollouts([RolloutCreate(input=None, rollout_id=uuid.uuid4().hex)])
        try:
            yield client, rollout.rollout_id
        finally:
            client.resume()
            client.delete_rollout(rollout.rollout_id)
            client.delete_models()


def _gateway_model(server_url: str, rollout_id: str, **kw: float) -> GatewayModel:
    http = httpx.Client(headers={"Authorization": f"Bearer {TEST_KEY}"}, timeout=60)
    return GatewayModel(http, proxy_base_url(server_url, rollout_id, "0", "train"), **kw)


def test_complete_retries_after_the_paused_gateways_429_then_succeeds(
    agl_server: AglServerProcess, paused_gateway: tuple[AglClient, str]
) -> None:
    client, rollout_id = paused_gateway
    client.pause("test", retry_after_seconds=1)
    with FaultProxy(agl_server.port) as proxy:
        result: list[list[int]] = []
        caller = threading.Thread(
            target=lambda: result.append(
                _gateway_model(proxy.url, rollout_id).complete([1], max_tokens=1).token_ids
            )
        )
        caller.start()
        deadline = time.monotonic() + 60
        while 429 not in proxy.statuses:  # the paused gateway answered the agent's first call
            assert time.monotonic() < deadline, "the paused gateway never answered the agent"
            time.sleep(0.02)
        client.resume()
        caller.join(timeout=60)
        calls = [path for _, path in proxy.requests]
    assert result == [[3]]
    assert proxy.statuses[0] == 429 and proxy.statuses[-1] == 200
    assert len(calls) >= 2 and all(path.endswith("/openai/v1/completions") for path in calls)


def test_complete_gives_up_when_the_gateways_pause_outlasts_max_pause_wait(
    agl_server: AglServerProcess, paused_gateway: tuple[AglClient, str]
) -> None:
    client, rollout_id = paused_gateway
    client.pause("test", retry_after_seconds=5)
    with pytest.raises(TimeoutError, match=r"paused for more than max_pause_wait=1 s"):
        _gateway_model(agl_server.url, rollout_id, max_pause_wait=1.0).complete([1], max_tokens=1)


def test_complete_raises_on_upstream_error_status() -> None:
    client = httpx.Client(transport=httpx.MockTransport(lambda _r: httpx.Response(503, json={"detail": "x"})))
    with pytest.raises(httpx.HTTPStatusError):
        GatewayModel(client, "http://g/v1").complete([1], max_tokens=1)


def test_complete_without_token_ids_names_the_missing_field() -> None:
    body = {"choices": [{"text": "a"}]}
    client = httpx.Client(transport=httpx.MockTransport(lambda _r: httpx.Response(200, json=body)))
    with pytest.raises(ValueError, match=r"no choices\[0\].token_ids"):
        GatewayModel(client, "http://g/v1").complete([1], max_tokens=1)
