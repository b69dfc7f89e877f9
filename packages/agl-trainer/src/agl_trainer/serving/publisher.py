"""Stage 10: after an update, make the inference servers serve the new weights.

Every publish, in every mode and the first after a (re)start too: the weights are staged on the
servers while the gateway still serves (``training/weight_stage_seconds``), then the gateway is
paused and the model calls in flight finish (recorded with the version that served them), the
weights are pushed (reloaded), the registrations move to the new version, and in the fully-async mode the gateway
resumes (the sync modes resume it when the next step starts). No call spans two versions. A push
that fails removes the registrations first, so no endpoint that took the new weights serves
calls recorded under the old version; the error names the endpoint. A pusher that loads each
version beside the previous one (LoRA adapters, :mod:`agl_trainer.serving.lora`) needs no pause:
its routes stay, the servers switch to the new version, and calls in flight finish on the old one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from agl_rollout import AglClient, model_registrations
from agl_trainer.serving.drain import Drain
from agl_trainer.serving.weights import WeightPusher
from agl_trainer.verl_glue.workers import PolicyWorkers


class Publisher:
    """Pushes the actor's weights with ``pusher`` and registers ``model_name`` on ``endpoints`` at the
    new version; ``resume`` reopens the gateway after each publish (fully async)."""

    def __init__(
        self,
        client: AglClient,
        pusher: WeightPusher,
        *,
        model_name: str,
        endpoints: Sequence[str],
        resume: bool,
        drain: Drain,
    ) -> None:
        self.client = client
        self.pusher = pusher
        self.model_name = model_name
        self.endpoints = tuple(endpoints)
        self.resume = resume
        self.drain = drain
        self.published: int | None = None

    def publish(self, workers: PolicyWorkers, version: int) -> dict[str, float]:
        """Serve ``version``; nothing to do when it is already served (a step that trained nothing)."""
        if self.published == version:
            return {}
        staging = time.perf_counter()  # the bytes move while the gateway still serves the old version
        staged = dict(self.pusher.stage(workers, version))
        staged["training/weight_stage_seconds"] = time.perf_counter() - staging
        if not self.pusher.pauses:
            return {**staged, **self._publish_beside(workers, version)}
        started = time.perf_counter()
        # Agents asking meanwhile retry after 1 s (the gateway's smallest Retry-After): a reload is short.
        drain = self.drain(self.client, f"publish weights v{version}", retry_after_seconds=1)
        metrics = self._push(workers, version)
        self.client.register_models(model_registrations(self.model_name, self.endpoints, version=version))
        if self.resume:
            self.client.resume()
        else:
            drain = {}  # the step's take already paused and drained: its metrics say what was in flight
        return {
            **staged,
            **metrics,
            **drain,
            "training/async/gateway_paused_seconds": time.perf_counter() - started,
        }

    def _publish_beside(self, workers: PolicyWorkers, version: int) -> dict[str, float]:
        """Load ``version`` beside the served one and register its routes at it, without a pause.

        The routes are the same at every version, so the registrations are updated in place: the
        gateway never lacks a server. The version a call is recorded with is the adapter the server
        answered it with (the pusher's ``served_adapter_prefix``), not the registration's.
        """
        metrics = self._push(workers, version)
        routes = [self.pusher.route(endpoint, version) for endpoint in self.endpoints]
        self.client.register_models(model_registrations(self.model_name, routes, version=version))
        return {**metrics, "training/async/gateway_paused_seconds": 0.0}

    def _push(self, workers: PolicyWorkers, version: int) -> dict[str, float]:
        """The pusher's push; a failed one leaves no registration (no endpoint serves under a wrong version)."""
        try:
            metrics = self.pusher.push(workers, version)
        except BaseException:
            self.client.delete_models()
            raise
        self.published = version
        return metrics


__all__ = ("Publisher",)
