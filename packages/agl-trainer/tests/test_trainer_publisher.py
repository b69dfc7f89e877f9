"""The publisher against the real agl-server: in the fully-async mode the weights change only while
the gateway is paused with no model call in flight, then the new version is registered and the
gateway resumes; in the sync modes it pushes alone (the gateway is already paused and drained)."""

from __future__ import annotations

from typing import Any

import pytest

from agl_rollout import AglClient, model_registrations
from agl_testing.agl_server import TEST_KEY, AglServerProcess
from agl_trainer.publisher import Publisher

pytestmark = [pytest.mark.server, pytest.mark.timeout(60)]

ENDPOINT = "http://127.0.0.1:9/v1"


class GatewayObservingPusher:
    """A weight pusher that records, at each push, the version and the gateway's state."""

    def __init__(self, client: AglClient) -> None:
        self.client = client
        self.pushes: list[tuple[int, bool, int]] = []

    def release(self) -> None:
        return None

    def push(self, workers: Any, version: int) -> dict[str, float]:
        state = self.client.proxy_state()
        self.pushes.append((version, state.paused, state.inflight))
        return {"training/weight_version": float(version)}


def _publisher(
    client: AglClient, version: list[int], *, fully_async: bool
) -> tuple[Publisher, GatewayObservingPusher]:
    pusher = GatewayObservingPusher(client)
    registrations = lambda: model_registrations("m", [ENDPOINT], version=version[0])  # noqa: E731
    return Publisher(client, pusher, registrations, fully_async=fully_async, drain_timeout_s=10.0), pusher


def test_fully_async_publish_pushes_while_paused_and_drained_then_registers_and_resumes(
    fresh_agl_server: AglServerProcess,
) -> None:
    version = [0]
    with AglClient(fresh_agl_server.url, TEST_KEY) as client:
        publisher, pusher = _publisher(client, version, fully_async=True)
        publisher.publish(workers=None, version=0)  # type: ignore[arg-type]  (the start-up push)
        client.register_models(model_registrations("m", [ENDPOINT], version=0))
        client.resume()
        registered: list[tuple[int, bool]] = []
        register = client.register_models

        def observed_register(models: Any) -> Any:
            registered.extend((m.version, client.proxy_state().paused) for m in models)
            return register(models)

        client.register_models = observed_register  # type: ignore[method-assign]
        version[0] = 1
        metrics = publisher.publish(workers=None, version=1)  # type: ignore[arg-type]
        state = client.proxy_state()
    assert pusher.pushes == [(0, False, 0), (1, True, 0)]
    assert registered == [(1, True)]  # the new version, registered before the gateway resumes
    assert not state.paused
    assert metrics["training/async/proxy_inflight_at_pause"] == 0.0
    assert metrics["training/async/gateway_paused_seconds"] >= metrics["training/async/proxy_drain_seconds"]


def test_publishing_the_served_version_again_does_not_pause_the_gateway(
    fresh_agl_server: AglServerProcess,
) -> None:
    with AglClient(fresh_agl_server.url, TEST_KEY) as client:
        publisher, pusher = _publisher(client, [0], fully_async=True)
        publisher.publish(workers=None, version=0)  # type: ignore[arg-type]
        client.resume()
        publisher.publish(workers=None, version=0)  # type: ignore[arg-type]  (a step that trained nothing)
        assert not client.proxy_state().paused
    assert pusher.pushes == [(0, False, 0), (0, False, 0)]


def test_sync_mode_publish_is_the_push_alone(fresh_agl_server: AglServerProcess) -> None:
    with AglClient(fresh_agl_server.url, TEST_KEY) as client:
        publisher, pusher = _publisher(client, [0], fully_async=False)
        publisher.publish(workers=None, version=0)  # type: ignore[arg-type]
        client.resume()
        metrics = publisher.publish(workers=None, version=1)  # type: ignore[arg-type]
        assert not client.proxy_state().paused
    assert pusher.pushes == [(0, False, 0), (1, False, 0)]
    assert metrics == {"training/weight_version": 1.0}
