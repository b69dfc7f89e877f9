"""An ASGI middleware for vLLM's OpenAI server: a URL per LoRA adapter.

``POST /agl/adapters/<name>/v1/<route>`` is served as ``POST /v1/<route>`` with the JSON body's
``model`` set to ``<name>``. agl-server's gateway sends every call under one model name (its
own); registering ``http://host:port/agl/adapters/<adapter>/v1`` as the endpoint makes the calls
it routes there use that adapter, so each weight version can be a LoRA adapter of its own name,
loaded while calls to the previous one finish. Requests outside the prefix pass unchanged.

Runs in vLLM's environment, which has no agl package: standard library only. Start vLLM with
``--middleware agl_adapter_route.AdapterRoute`` and this folder on ``PYTHONPATH``.
"""

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

PREFIX = "/agl/adapters/"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class AdapterRoute:
    """Serves ``/agl/adapters/<name>/<path>`` as ``/<path>`` with ``model`` set to ``<name>``."""

    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        name, _, rest = path[len(PREFIX) :].partition("/")
        body = await _read_body(receive)
        try:
            payload = json.loads(body) if body else {}
        except ValueError:
            payload = None
        if not name or not isinstance(payload, dict):
            await _bad_request(send, "expected /agl/adapters/<name>/<route> with a JSON object body")
            return
        payload["model"] = name
        rewritten = json.dumps(payload).encode()
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(rewritten)).encode()))
        inner = {**scope, "path": "/" + rest, "raw_path": ("/" + rest).encode(), "headers": headers}
        await self.app(inner, _replay(rewritten, receive), send)


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` that hands over ``body`` once, then defers to the client's (its disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


async def _bad_request(send: Send, detail: str) -> None:
    content = json.dumps({"error": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": content})
