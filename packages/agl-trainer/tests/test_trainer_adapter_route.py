"""The vLLM middleware that gives each LoRA adapter a URL, driven as the ASGI server drives it.

The app behind it records what it received; the real vLLM behind it is exercised in
``test_trainer_lora_on_vllm_cpu.py``.
"""

from __future__ import annotations

import asyncio
import json
from types import ModuleType
from typing import Any

import pytest

from agl_testing.vllm_child import vllm_child_module
from agl_trainer.serving.lora import adapter_name, adapter_route


def _route_module() -> ModuleType:
    return vllm_child_module("agl_adapter_route")


class RecordingApp:
    """An ASGI app that keeps the scope and the whole body it received, and answers 200."""

    def __init__(self) -> None:
        self.scope: dict[str, Any] = {}
        self.body = b""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.scope = dict(scope)
        while True:
            message = await receive()
            self.body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def _call(path: str, chunks: list[bytes]) -> tuple[RecordingApp, list[dict[str, Any]]]:
    """POST ``chunks`` (the body, in pieces) to ``path`` through the middleware; the app and what was sent."""
    app = RecordingApp()
    route = _route_module().AdapterRoute(app)
    pending = [
        {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
        for i, chunk in enumerate(chunks)
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    length = str(sum(len(c) for c in chunks)).encode()
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "headers": [(b"content-type", b"application/json"), (b"content-length", length)],
    }
    asyncio.run(route(scope, receive, send))
    return app, sent


def test_an_adapter_url_is_served_as_the_v1_route_with_the_adapter_as_model() -> None:
    body = json.dumps({"model": "agl-model", "prompt": [1, 2], "max_tokens": 2}).encode()
    app, sent = _call("/agl/adapters/agl-model-v3/v1/completions", [body[:7], body[7:]])
    assert (app.scope["path"], app.scope["raw_path"]) == ("/v1/completions", b"/v1/completions")
    assert json.loads(app.body) == {"model": "agl-model-v3", "prompt": [1, 2], "max_tokens": 2}
    assert dict(app.scope["headers"])[b"content-length"] == str(len(app.body)).encode()
    assert sent[0]["status"] == 200


def test_a_request_outside_the_prefix_passes_unchanged() -> None:
    body = json.dumps({"model": "agl-model", "prompt": [1]}).encode()
    app, _ = _call("/v1/completions", [body])
    assert (app.scope["path"], app.body) == ("/v1/completions", body)


@pytest.mark.parametrize(
    ("path", "body"), [("/agl/adapters//v1/completions", b"{}"), ("/agl/adapters/a/v1/completions", b"[1]")]
)
def test_an_adapter_url_without_a_name_or_a_json_object_is_a_bad_request(path: str, body: bytes) -> None:
    app, sent = _call(path, [body])
    assert app.scope == {}
    assert sent[0]["status"] == 400
    assert b"/agl/adapters/<name>/<route>" in sent[1]["body"]


def test_the_listing_counts_each_adapters_calls_until_their_responses_are_sent() -> None:
    """A call is counted from its arrival until the app has sent the whole response; an adapter
    with no call left is not listed."""

    async def scenario() -> list[dict[str, int]]:
        release = asyncio.Event()

        async def slow_app(scope: Any, receive: Any, send: Any) -> None:
            await receive()
            await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

        route = _route_module().AdapterRoute(slow_app)

        async def post(path: str) -> None:
            async def receive() -> dict[str, Any]:
                return {"type": "http.request", "body": b"{}", "more_body": False}

            async def send(message: dict[str, Any]) -> None:
                return None

            await route({"type": "http", "method": "POST", "path": path, "headers": []}, receive, send)

        async def listing() -> dict[str, int]:
            sent: list[dict[str, Any]] = []

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            async def receive() -> dict[str, Any]:
                return {"type": "http.disconnect"}

            await route(
                {"type": "http", "method": "GET", "path": "/agl/adapters", "headers": []}, receive, send
            )
            assert sent[0]["status"] == 200
            return json.loads(sent[1]["body"])["calls_in_flight"]

        calls = [
            asyncio.create_task(post(f"/agl/adapters/{name}/v1/completions"))
            for name in ("m-v1", "m-v1", "m-v2")
        ]
        await asyncio.sleep(0.01)
        during = await listing()
        release.set()
        await asyncio.gather(*calls)
        return [during, await listing()]

    during, after = asyncio.run(scenario())
    assert during == {"m-v1": 2, "m-v2": 1}
    assert after == {}


def test_an_adapter_of_a_model_path_is_named_in_one_url_path_segment() -> None:
    name = adapter_name("/models/qwen2.5-1.5b", 3)
    assert name == "_models_qwen2.5-1.5b-v3"
    assert (
        adapter_route("http://vllm-0:8000/v1", name)
        == "http://vllm-0:8000/agl/adapters/_models_qwen2.5-1.5b-v3/v1"
    )


def _request(route: Any, method: str, path: str, body: bytes) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(route({"type": "http", "method": method, "path": path, "headers": []}, receive, send))
    return sent


def test_the_current_url_is_answered_by_the_adapter_last_made_current() -> None:
    app = RecordingApp()
    route = _route_module().AdapterRoute(app)
    completions = "/agl/adapters/current/v1/completions"
    assert _request(route, "POST", completions, b"{}")[0]["status"] == 503  # none current yet
    for name in ("m-v1", "m-v2"):
        made = _request(route, "PUT", "/agl/adapters/current", json.dumps({"name": name}).encode())
        assert (made[0]["status"], json.loads(made[1]["body"])) == (200, {"current": name})
    assert _request(route, "POST", completions, json.dumps({"model": "m"}).encode())[0]["status"] == 200
    assert (app.scope["path"], json.loads(app.body)) == ("/v1/completions", {"model": "m-v2"})


@pytest.mark.parametrize("body", [b"[]", b'{"name": ""}', b'{"name": "a/b"}', b'{"name": "current"}', b"x"])
def test_making_current_anything_but_one_adapter_name_is_a_bad_request(body: bytes) -> None:
    sent = _request(_route_module().AdapterRoute(RecordingApp()), "PUT", "/agl/adapters/current", body)
    assert sent[0]["status"] == 400
