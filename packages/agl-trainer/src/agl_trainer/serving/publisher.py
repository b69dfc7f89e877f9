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

With a :class:`~agl_trainer.serving.fleet.Fleet` (external servers), every publish first checks
every server (a dead one out, one that came back caught up and in again), pushes to the live ones
only, and a push that fails on some of them takes those out instead of stopping the run; the run
stops only when no server is left. Each publish's metrics then carry ``serving/servers_live`` and
``serving/server_failures``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from agl_rollout import AglClient, model_registrations
from agl_trainer.serving.drain import Drain
from agl_trainer.serving.errors import WeightPushError
from agl_trainer.serving.fleet import Fleet, calls_share
from agl_trainer.serving.weights import WeightPusher
from agl_trainer.verl_glue.workers import PolicyWorkers
from agl_types import CompletedRollout


class Publisher:
    """Pushes the actor's weights with ``pusher`` and registers ``model_name`` on ``endpoints`` at the
    new version; ``resume`` reopens the gateway after each publish (fully async); ``fleet``: the
    external servers' health and membership (the pusher's ``endpoints`` are set to its live ones)."""

    def __init__(
        self,
        client: AglClient,
        pusher: WeightPusher,
        *,
        model_name: str,
        endpoints: Sequence[str],
        resume: bool,
        drain: Drain,
        fleet: Fleet | None = None,
    ) -> None:
        self.client = client
        self.pusher = pusher
        self.model_name = model_name
        self.endpoints = tuple(endpoints)
        self.resume = resume
        self.drain = drain
        self.fleet = fleet
        self.published: int | None = None

    def publish(self, workers: PolicyWorkers, version: int) -> dict[str, float]:
        """Serve ``version``; nothing to do when it is already served (a step that trained nothing)
        but check the servers."""
        if self.fleet is None:
            return self._publish(workers, version)
        self.fleet.check()
        self.fleet.require_live()
        return {**self._publish(workers, version), **self.fleet.metrics()}

    def serving_metrics(self, rollouts: Iterable[CompletedRollout]) -> dict[str, float]:
        """The fleet's metrics now and each server's share of ``rollouts``' calls (none without a fleet)."""
        if self.fleet is None:
            return {}
        return {**calls_share(rollouts, self.fleet.endpoints), **self.fleet.metrics()}

    def _publish(self, workers: PolicyWorkers, version: int) -> dict[str, float]:
        if self.published == version:
            return {}
        staging = time.perf_counter()  # the bytes move while the gateway still serves the old version
        staged = self._stage(workers, version)
        staged["training/weight_stage_seconds"] = time.perf_counter() - staging
        if not self.pusher.pauses:
            return {**staged, **self._publish_beside(workers, version)}
        started = time.perf_counter()
        # Agents asking meanwhile retry after 1 s (the gateway's smallest Retry-After): a reload is short.
        drain = self.drain(self.client, f"publish weights v{version}", retry_after_seconds=1)
        metrics = self._push(workers, version)
        self._register(self.endpoints, version)
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
        self._register([self.pusher.route(endpoint, version) for endpoint in self.endpoints], version)
        return {**metrics, "training/async/gateway_paused_seconds": 0.0}

    def _register(self, routes: Sequence[str], version: int) -> None:
        if self.fleet is not None:
            self.fleet.register(version)
        else:
            self.client.register_models(model_registrations(self.model_name, routes, version=version))

    def _use_live_servers(self) -> None:
        if self.fleet is not None:
            self.pusher.endpoints = self.fleet.live()  # pyright: ignore[reportAttributeAccessIssue]

    def _stage(self, workers: PolicyWorkers, version: int) -> dict[str, float]:
        """The pusher's stage, to the fleet's live servers; the servers it failed on are taken out
        (they still serve the old version, registered as such), the run stops when none is left."""
        self._use_live_servers()
        try:
            return dict(self.pusher.stage(workers, version))
        except WeightPushError as exc:
            if self.fleet is None or not exc.failures:
                raise
            self.fleet.push_failed(exc.failures)
            self.fleet.require_live()
            return {}

    def _push(self, workers: PolicyWorkers, version: int) -> dict[str, float]:
        """The pusher's push; a failed one leaves no registration (no endpoint serves under a wrong
        version), except that the fleet's servers it reached stay when it failed on some only."""
        self._use_live_servers()
        try:
            metrics = self.pusher.push(workers, version)
        except WeightPushError as exc:
            if self.fleet is None or not exc.failures:
                self.client.delete_models()
                raise
            # Out before anything is registered at the new version: they still hold the old weights.
            self.fleet.push_failed(exc.failures)
            try:
                self.fleet.require_live()
            except BaseException:
                self.client.delete_models()
                raise
            metrics = {"training/weight_version": float(version)}
        except BaseException:
            self.client.delete_models()
            raise
        self.published = version
        return metrics


__all__ = ("Publisher",)
