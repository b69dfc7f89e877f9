"""Adapter-only weight pushes to external vLLM servers, for an actor that trains a LoRA adapter.

Each version is the actor's adapter alone (``actor_rollout_ref.model.lora_rank > 0``), saved as a
PEFT folder under ``weights_dir/adapter_<version>`` and loaded on every server under the name
``<model>-v<version>`` through vLLM's runtime LoRA loading. The gateway sends every call under one
model name to one URL per server, ``.../agl/adapters/current/v1``, which the servers'
``agl_adapter_route`` middleware answers with the adapter the trainer made current; a push loads
the new adapter and makes it current, so the registrations never change and the gateway is never
paused. Calls already running finish on the adapter they started with. vLLM answers each call
under the adapter's name, which is how its version is recorded (agl-rollout's
``served_adapter_prefix``). An adapter older than the last two is unloaded at the first push that
finds no call using it (the middleware counts them).
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import httpx

from agl_trainer.serving.errors import WeightPushError
from agl_trainer.serving.vllm_client import VllmClient, server_root
from agl_trainer.verl_glue.workers import PolicyWorkers

logger = logging.getLogger(__name__)

CURRENT = "current"
"""The adapter-route middleware's name for the adapter the trainer made current."""

ADAPTERS_KEPT = 2
"""Adapters a server keeps loaded at least: the new version and the one made current before it;
older ones stay only while calls still use them."""


def adapter_name(model: str, version: int) -> str:
    """The name weight version ``version``'s adapter is loaded under: the served model's name with
    every character a URL path segment cannot hold as is (``/`` of a model path) made ``_``."""
    return f"{_adapter_prefix(model)}{version}"


def _adapter_prefix(model: str) -> str:
    return re.sub(r"[^A-Za-z0-9._~-]", "_", model) + "-v"


def adapter_route(endpoint: str, name: str) -> str:
    """The OpenAI base URL at which ``endpoint``'s server answers with the adapter ``name``."""
    return f"{server_root(endpoint)}/agl/adapters/{name}/v1"


class ExternalLoraPush:
    """Save the actor's adapter and load it on every server under its version's name."""

    pauses = False
    """Calls in flight finish on their adapter: the gateway stays open during a push."""

    def __init__(self, endpoints: Sequence[str], model: str, weights_dir: Path) -> None:
        self.endpoints = tuple(endpoints)
        self.model = model
        self.weights_dir = Path(weights_dir)
        self.served_version: int | None = None
        self._loaded: list[int] = []

    def release(self) -> None:
        return None  # the servers run on their own devices

    @property
    def served_adapter_prefix(self) -> str:
        return _adapter_prefix(self.model)

    def route(self, endpoint: str, version: int) -> str:
        """The same URL at every version: the server's current adapter answers it."""
        return adapter_route(endpoint, CURRENT)

    def push(self, workers: PolicyWorkers, version: int) -> dict[str, float]:
        """Load ``version``'s adapter on every server (the first push also unloads what a run before
        this one left loaded, and finds a server without the adapter middleware); unload the
        adapters older than the last :data:`ADAPTERS_KEPT` that no call uses any more."""
        if version == self.served_version:
            return {"training/weight_version": float(version)}
        target = workers.save_lora_adapter(self.weights_dir / f"adapter_{version}")
        name = adapter_name(self.model, version)
        first = self.served_version is None
        for endpoint in self.endpoints:
            try:
                with VllmClient(server_root(endpoint), self.model) as client:
                    if first:
                        client.adapter_calls_in_flight()  # the middleware is there
                    client.load_lora_adapter(name, target)
                    client.make_adapter_current(name)
                    if first:
                        for other in client.lora_adapters():
                            if other != name and other.startswith(_adapter_prefix(self.model)):
                                client.unload_lora_adapter(other)
            except httpx.HTTPError as exc:
                raise WeightPushError(
                    f"could not push the LoRA adapter of version {version} ({target}) to the vLLM server at "
                    f"{endpoint}: {exc!r}; check agentlightning.external_servers.endpoints"
                ) from exc
            except WeightPushError as exc:
                raise WeightPushError(f"{endpoint}: {exc}") from exc
        self._loaded.append(version)
        self.served_version = version
        try:
            self._unload_unused()
        except (httpx.HTTPError, WeightPushError) as exc:  # the push itself worked: try again next time
            logger.warning("old LoRA adapters not unloaded this time (the next push tries again): %r", exc)
        return {
            "training/weight_version": float(version),
            "training/weight_push_bytes": float(sum(f.stat().st_size for f in target.iterdir())),
            "training/lora_adapters_loaded": float(len(self._loaded)),
        }

    def _unload_unused(self) -> None:
        """Unload, on every server, each adapter older than the last :data:`ADAPTERS_KEPT` whose URL
        answers no call on any server, and remove its folder (vLLM may reread a loaded one's)."""
        old = self._loaded[:-ADAPTERS_KEPT]
        if not old:
            return
        clients = [VllmClient(server_root(endpoint), self.model) for endpoint in self.endpoints]
        try:
            busy = {
                name for client in clients for name, n in client.adapter_calls_in_flight().items() if n > 0
            }
            for version in old:
                name = adapter_name(self.model, version)
                if name in busy:
                    continue
                for client in clients:
                    client.unload_lora_adapter(name)
                shutil.rmtree(self.weights_dir / f"adapter_{version}", ignore_errors=True)
                self._loaded.remove(version)
        finally:
            for client in clients:
                client.close()


__all__ = ("ADAPTERS_KEPT", "CURRENT", "ExternalLoraPush", "adapter_name", "adapter_route")
