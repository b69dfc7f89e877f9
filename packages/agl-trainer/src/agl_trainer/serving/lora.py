"""Adapter-only weight pushes to external vLLM servers, for an actor that trains a LoRA adapter.

Each version is the actor's adapter alone (``actor_rollout_ref.model.lora_rank > 0``), saved as a
PEFT folder under ``weights_dir/adapter_<version>``, uploaded to each server's own staging folder
(or read from ``weights_dir`` where the servers share it, :mod:`agl_trainer.serving.transfer`),
and loaded on every server at once under the name ``<model>-v<version>`` through vLLM's runtime
LoRA loading. The gateway sends every call under one
model name to one URL per server, ``.../agl/adapters/current/v1``, which the servers'
``agl_adapter_route`` middleware answers with the adapter the trainer made current; a push loads
the new adapter and makes it current, so the registrations never change and the gateway is never
paused. Calls already running finish on the adapter they started with. vLLM answers each call
under the adapter's name, which is how its version is recorded (agl-rollout's
``served_adapter_prefix``). An adapter older than the last two is unloaded at the first push that
finds no call using it (the middleware counts them), and so is one an earlier run left loaded
(the first push unloads those no call uses at once). The middleware's state lives in one API-server
process, so a server with several (``--api-server-count`` ≥ 2) is refused at the first push.
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from agl_trainer.serving.errors import WeightPushError
from agl_trainer.serving.probe import check_probe, served_probe
from agl_trainer.serving.transfer import on_each, place, push_failed
from agl_trainer.serving.vllm_client import VllmClient, server_root
from agl_trainer.serving.weights import Staged
from agl_trainer.verl_glue.workers import PolicyWorkers

if TYPE_CHECKING:
    from agl_trainer.settings.server import Transfer

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
    """Save the actor's adapter, get it to every server (:meth:`stage`), and load it there under its
    version's name, on all servers at once (:meth:`push`).

    ``transfer`` and ``endpoints`` as :class:`~agl_trainer.serving.weights.ExternalVllmPush`'s.
    """

    pauses = False
    """Calls in flight finish on their adapter: the gateway stays open during a push."""

    def __init__(
        self, endpoints: Sequence[str], model: str, weights_dir: Path, *, transfer: Transfer = "upload"
    ) -> None:
        self.endpoints = tuple(endpoints)
        self.model = model
        self.weights_dir = Path(weights_dir)
        self.transfer: Transfer = transfer
        self.served_version: int | None = None
        self.served_logprobs: list[float] | None = None
        """The probe's log-probs under the served adapter, as a server answered them at its push."""
        self._loaded: list[int] = []
        self._left_loaded: set[tuple[str, str]] = set()
        """(endpoint, adapter) an earlier run left loaded that a call still used at the first push."""
        self._staged: Staged | None = None

    def release(self) -> None:
        return None  # the servers run on their own devices

    @property
    def served_adapter_prefix(self) -> str:
        return _adapter_prefix(self.model)

    def route(self, endpoint: str, version: int) -> str:
        """The same URL at every version: the server's current adapter answers it."""
        return adapter_route(endpoint, CURRENT)

    def stage(self, workers: PolicyWorkers, version: int) -> dict[str, float]:
        """Save ``version``'s adapter and get it to every server; nothing is loaded yet."""
        if version == self.served_version:
            return {}
        staged, failures = self._stage_on(workers, version, self.endpoints)
        if failures:
            raise push_failed(
                f"the LoRA adapter of version {version} ({staged.folder})", len(self.endpoints), failures
            )
        return {}

    def push(self, workers: PolicyWorkers, version: int) -> dict[str, float]:
        """Load ``version``'s adapter on every server at once and make it current (the first push also
        unloads what a run before this one left loaded, and finds a server without the adapter
        middleware); unload the adapters older than the last :data:`ADAPTERS_KEPT` that no call uses
        any more."""
        if version == self.served_version:
            return {"training/weight_version": float(version)}
        staged, failures = self._stage_on(workers, version, self.endpoints)
        name = adapter_name(self.model, version)
        first = self.served_version is None
        served, load_failures = on_each(
            [endpoint for endpoint in self.endpoints if endpoint in staged.paths],
            lambda endpoint: self._serve(endpoint, name, staged.paths[endpoint], clean=first),
        )
        failures.update(load_failures)
        if served:
            self._loaded.append(version)
            self.served_version = version
            self.served_logprobs = next(iter(served.values()))
            self._staged = None
            try:
                self._unload_unused()
            except (httpx.HTTPError, WeightPushError) as exc:  # the push itself worked: try again next time
                logger.warning(
                    "old LoRA adapters not unloaded this time (the next push tries again): %r", exc
                )
        if failures:
            raise push_failed(
                f"the LoRA adapter of version {version} ({staged.folder})", len(self.endpoints), failures
            )
        return {
            "training/weight_version": float(version),
            "training/weight_push_bytes": float(sum(f.stat().st_size for f in staged.folder.iterdir())),
            "training/lora_adapters_loaded": float(len(self._loaded)),
        }

    def catch_up(self, endpoint: str) -> None:
        """Bring ``endpoint``'s server (one that restarted) to the served adapter from the trainer's
        copy of it, made current there, and check its probe log-probs against the served version's."""
        if self.served_version is None:  # nothing pushed yet: the server needs only the middleware
            self._meet(endpoint)
            return
        version = self.served_version
        folder = self.weights_dir / f"adapter_{version}"
        what = f"the LoRA adapter of version {version} ({folder})"
        self._meet(endpoint)
        paths, failures = place(self.transfer, [endpoint], self.model, folder)
        if not failures:
            _, failures = on_each(
                [endpoint], lambda e: self._serve(e, adapter_name(self.model, version), paths[e], clean=True)
            )
        if failures:
            raise push_failed(what, 1, failures)
        check_probe(endpoint, adapter_name(self.model, version), what, self.served_logprobs)

    def _stage_on(
        self, workers: PolicyWorkers, version: int, endpoints: Sequence[str]
    ) -> tuple[Staged, dict[str, str]]:
        """Save ``version``'s adapter (once) and place it on those of ``endpoints`` that lack it (on
        a run's first push, after meeting each server: :meth:`_meet`)."""
        staged = self._staged
        if staged is None or staged.version != version:
            folder = workers.save_lora_adapter(self.weights_dir / f"adapter_{version}")
            staged = self._staged = Staged(version, folder)
        missing = [endpoint for endpoint in endpoints if endpoint not in staged.paths]
        failures: dict[str, str] = {}
        if self.served_version is None:
            _, failures = on_each(missing, self._meet)
            missing = [endpoint for endpoint in missing if endpoint not in failures]
        # vLLM may reread a loaded adapter's folder: the run's own, and those a call still uses.
        keep = [f"adapter_{loaded}" for loaded in self._loaded]
        keep += sorted({self._folder(name) for _, name in self._left_loaded})
        paths, place_failures = place(self.transfer, missing, self.model, staged.folder, keep=keep)
        staged.paths.update(paths)
        return staged, {**failures, **place_failures}

    def _meet(self, endpoint: str) -> None:
        """A run's first contact with ``endpoint``'s server: refuse several API servers, and note the
        adapters of this model an earlier run left loaded that calls still use."""
        with VllmClient(server_root(endpoint), self.model) as client:
            client.require_one_api_server()
            for name, calls in client.adapter_calls_in_flight().items():
                if calls > 0 and name.startswith(_adapter_prefix(self.model)):
                    self._left_loaded.add((endpoint, name))

    def _folder(self, name: str) -> str:
        """The staged folder of the adapter loaded as ``name``."""
        return f"adapter_{name.removeprefix(_adapter_prefix(self.model))}"

    def _serve(self, endpoint: str, name: str, path: str, *, clean: bool) -> list[float]:
        """Load the adapter at ``path`` on ``endpoint``'s server as ``name`` and make it current (with
        ``clean``, then unload the run's other adapters there that no call uses); the probe's
        log-probs under it."""
        with VllmClient(server_root(endpoint), self.model) as client:
            client.load_lora_adapter(name, Path(path))
            client.make_adapter_current(name)
            if clean:
                busy = {other for other, n in client.adapter_calls_in_flight().items() if n > 0}
                for other in client.lora_adapters():
                    if other != name and other.startswith(_adapter_prefix(self.model)) and other not in busy:
                        self._unload_left(client, endpoint, other)
        return served_probe(endpoint, name)

    def _unload_left(self, client: VllmClient, endpoint: str, name: str) -> None:
        """Unload ``name``, which an earlier run left on ``endpoint``'s server, and its staged folder
        where it was kept for a call."""
        client.unload_lora_adapter(name)
        if (endpoint, name) in self._left_loaded:
            if self.transfer == "upload":
                client.unstage(self._folder(name))
            self._left_loaded.discard((endpoint, name))

    def _unload_unused(self) -> None:
        """Unload, on every server, each adapter older than the last :data:`ADAPTERS_KEPT` whose URL
        answers no call on any server, and remove its folders, the trainer's and the servers' staged
        copies (vLLM may reread a loaded one's); and each adapter an earlier run left loaded that no
        call uses any more."""
        old = self._loaded[:-ADAPTERS_KEPT]
        if not old and not self._left_loaded:
            return
        clients = {endpoint: VllmClient(server_root(endpoint), self.model) for endpoint in self.endpoints}
        try:
            busy = {
                name
                for client in clients.values()
                for name, n in client.adapter_calls_in_flight().items()
                if n > 0
            }
            for version in old:
                name = adapter_name(self.model, version)
                if name in busy:
                    continue
                for client in clients.values():
                    client.unload_lora_adapter(name)
                    if self.transfer == "upload":
                        client.unstage(f"adapter_{version}")
                shutil.rmtree(self.weights_dir / f"adapter_{version}", ignore_errors=True)
                self._loaded.remove(version)
            for endpoint, name in sorted(self._left_loaded):
                if name not in busy and endpoint in clients:
                    self._unload_left(clients[endpoint], endpoint, name)
        finally:
            for client in clients.values():
                client.close()


__all__ = ("ADAPTERS_KEPT", "CURRENT", "ExternalLoraPush", "adapter_name", "adapter_route")
