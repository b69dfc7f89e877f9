"""Pipeline stage 3: after an update, make the inference servers serve the new weights.

In the sync modes the gateway is already paused and drained when the step trains, so publishing
is the push alone (the next wait registers the new version). In the fully-async mode the gateway
is open: it is paused, the model calls in flight finish (and are recorded with the version that
served them), the weights are reloaded, the registrations are moved to the new version, and the
gateway resumes. No call spans two versions, and agents wait only for the reload.
"""

from __future__ import annotations

import time

from agl_rollout import AglClient
from agl_trainer.collection import Registrations
from agl_trainer.drain import Drain
from agl_trainer.weights import WeightPusher
from agl_trainer.workers import PolicyWorkers


class Publisher:
    """Pushes the actor's weights with ``pusher``; ``fully_async`` also pauses and re-registers the gateway."""

    def __init__(
        self,
        client: AglClient,
        pusher: WeightPusher,
        registrations: Registrations,
        *,
        fully_async: bool,
        drain: Drain,
    ) -> None:
        self.client = client
        self.pusher = pusher
        self.registrations = registrations
        self.fully_async = fully_async
        self.drain = drain
        self.published: int | None = None

    def publish(self, workers: PolicyWorkers, version: int) -> dict[str, float]:
        """Serve ``version``; a no-op (but for the metric) when it is already served."""
        if not self.fully_async or self.published in (None, version):
            metrics = self.pusher.push(workers, version)
            self.published = version
            return metrics
        started = time.perf_counter()
        # Agents asking meanwhile retry after 1 s (the gateway's smallest Retry-After): a reload is short.
        drain = self.drain(self.client, f"publish weights v{version}", retry_after_seconds=1)
        try:
            metrics = self.pusher.push(workers, version)
            self.published = version
            self.client.register_models(self.registrations())
        finally:
            self.client.resume()
        return {
            **metrics,
            **drain,
            "training/async/gateway_paused_seconds": time.perf_counter() - started,
        }


__all__ = ("Publisher",)
