"""An ASGI middleware for vLLM's OpenAI server: a URL per LoRA adapter.

``POST /agl/adapters/<name>/v1/<route>`` is served as ``POST /v1/<route>`` with the JSON body's
``model`` set to ``<name>``. agl-server's gateway sends every call under one model name (its
own); registering ``http://host:port/agl/adapters/<adapter>/v1`` as the endpoint makes the calls
it routes there use that adapter, so each weight version can be a LoRA adapter of its own name,
loaded while calls to the previous one finish. Requests outside the prefix pass unchanged.

``/agl/adapters/current/v1/<route>`` is answered by the adapter last named by
``PUT /agl/adapters/current`` (body ``{"name": <adapter>}``): registered once, that URL moves to
each new weight version without the gateway's registrations changing. vLLM answers a call under
the adapter's name, which records which one served it.

``GET /agl/adapters`` answers ``{"calls_in_flight": {<name>: <count>}, "api_server": <process name>}``:
the calls each adapter's URL is answering now (adapters with none left out), so the trainer
unloads an old adapter only once no call uses it, and the name of the process answering. That
state lives in one API-server process: vLLM started with ``--api-server-count`` 2 or more runs its
API servers as processes named ``ApiServer_<i>``, each with its own, which the trainer refuses.

The same middleware serves ``/agl/weights`` (:mod:`agl_weight_staging`): weights uploaded into a
folder on the server's own disk, for servers that share no folder with the trainer.

Runs in vLLM's environment, which has no agl package: standard library only. Start vLLM with
``--middleware agl_adapter_route.AdapterRoute`` and this folder on ``PYTHONPATH``.
"""

import json
import multiprocessing
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from agl_weight_staging import WeightStaging, read_body  # pyright: ignore[reportMissingImports]  (vLLM's PYTHONPATH has this folder)

PREFIX = "/agl/adapters/"
LISTING = PREFIX.rstrip("/")
CURRENT = "current"
API_SERVER = multiprocessing.current_process().name
"""This process's name: ``MainProcess`` for vLLM's single API server, ``ApiServer_<i>`` for one of several."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class AdapterRoute:
    """Serves ``/agl/adapters/<name>/<path>`` as ``/<path>`` with ``model`` set to ``<name>``."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.calls_in_flight: dict[str, int] = {}
        self.current: str | None = None
        self.weights = WeightStaging.from_env()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and self.weights.handles(path):
            await self.weights(scope, receive, send)
            return
        if scope["type"] == "http" and path.rstrip("/") == LISTING and scope.get("method") == "GET":
            listing = {"calls_in_flight": dict(self.calls_in_flight), "api_server": API_SERVER}
            await _answer(send, 200, listing)
            return
        if scope["type"] != "http" or not path.startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        name, _, rest = path[len(PREFIX) :].partition("/")
        if name == CURRENT and not rest.strip("/") and scope.get("method") == "PUT":
            await self._make_current(receive, send)
            return
        if name == CURRENT:
            if self.current is None:
                await _answer(
                    send, 503, {"error": "no adapter is current yet: PUT /agl/adapters/current first"}
                )
                return
            name = self.current
        # Counted from its arrival, its body still coming, until the app has sent the whole
        # response (the app returns after a stream's last chunk).
        self.calls_in_flight[name] = self.calls_in_flight.get(name, 0) + 1
        try:
            await self._serve(scope, name, rest, receive, send)
        finally:
            self.calls_in_flight[name] -= 1
            if not self.calls_in_flight[name]:
                del self.calls_in_flight[name]

    async def _make_current(self, receive: Receive, send: Send) -> None:
        try:
            payload = json.loads(await read_body(receive))
        except ValueError:
            payload = None
        name = payload.get("name") if isinstance(payload, dict) else None
        if not isinstance(name, str) or not name or "/" in name or name == CURRENT:
            await _bad_request(send, 'expected {"name": <adapter name>} (one path segment, not "current")')
            return
        self.current = name
        await _answer(send, 200, {"current": name})

    async def _serve(self, scope: Scope, name: str, rest: str, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
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
    await _answer(send, 400, {"error": detail})


async def _answer(send: Send, status: int, answer: dict[str, Any]) -> None:
    content = json.dumps(answer).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": content})
