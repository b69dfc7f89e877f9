"""The publisher against the real agl-server: in every mode, the first publish included, the weights
change only while the gateway is paused with no model call in flight, then the new version is
registered; the fully-async mode resumes the gateway, the sync modes leave that to the next step.
A failed push leaves no endpoint registered."""

from __future__ import annotations

import http.server
import json
import threading
import time
from typing import Any

import httpx
import pytest

from agl_rollout import AglClient, model_registrations
from agl_rollout.queueing import rollout_request
from agl_testing.agl_server import TEST_KEY, TEST_MODEL_NAME, AglServerProcess
from agl_testing.fault_proxy import FaultProxy
from agl_trainer.assembly import compose_config
from agl_trainer.serving.drain import Drain
from agl_trainer.serving.errors import WeightPushError
from agl_trainer.serving.lora import adapter_route
from agl_trainer.serving.publisher import Publisher
from agl_trainer.serving.weights import ReplacesServedWeights
from agl_trainer.settings import parse_settings
from agl_types import RolloutConfig, RolloutState, RolloutStatusPatch

pytestmark = [pytest.mark.server, pytest.mark.timeout(60)]

ENDPOINT = "http://127.0.0.1:9/v1"


class GatewayObservingPusher(ReplacesServedWeights):
    """A weight pusher that records, at each push, the version and the gateway's state; with
    ``beside``, it loads each version beside the served one and makes it current (as LoRA adapters
    are), at one route for every version."""

    def __init__(self, client: AglClient, *, beside: bool = False) -> None:
        self.client = client
        self.pushes: list[tuple[int, bool, int]] = []
        self.stages: list[tuple[int, bool]] = []
        self.pauses = not beside

    def route(self, endpoint: str, version: int) -> str:
        return endpoint if self.pauses else adapter_route(endpoint, "current")

    def release(self) -> None:
        return None

    def stage(self, workers: Any, version: int) -> dict[str, float]:
        self.stages.append((version, self.client.proxy_state().paused))
        return {}

    def push(self, workers: Any, version: int) -> dict[str, float]:
        state = self.client.proxy_state()
        self.pushes.append((version, state.paused, state.inflight))
        return {"training/weight_version": float(version)}


def _publisher(
    client: AglClient, *, fully_async: bool, beside: bool = False
) -> tuple[Publisher, GatewayObservingPusher]:
    pusher = GatewayObservingPusher(client, beside=beside)
    publisher = Publisher(
        client, pusher, model_name="m", endpoints=[ENDPOINT], resume=fully_async, drain=Drain(10.0, 0.02)
    )
    return publisher, pusher


def test_fully_async_publish_pushes_while_paused_and_drained_then_registers_and_resumes(
    fresh_agl_server: AglServerProcess,
) -> None:
    with AglClient(fresh_agl_server.url, TEST_KEY) as client:
        publisher, pusher = _publisher(client, fully_async=True)
        publisher.publish(workers=None, version=0)  # type: ignore[arg-type]  (the start-up push)
        client.register_models(model_registrations("m", [ENDPOINT], version=0))
        client.resume()
        registered: list[tuple[int, bool]] = []
        register = client.register_models

        def observed_register(models: Any) -> Any:
            registered.extend((m.version, client.proxy_state().paused) for m in models)
            return register(models)

        client.register_models = observed_register  # type: ignore[method-assign]
        metrics = publisher.publish(workers=None, version=1)  # type: ignore[arg-type]
        state = client.proxy_state()
    assert pusher.pushes == [(0, True, 0), (1, True, 0)]  # the start-up push is drained too
    assert registered == [(1, True)]  # the new version, registered before the gateway resumes
    assert not state.paused
    assert metrics["training/async/proxy_inflight_at_pause"] == 0.0
    assert metrics["training/async/gateway_paused_seconds"] >= metrics["training/async/proxy_drain_seconds"]


@pytest.mark.parametrize("beside", [False, True])
def test_a_publish_stages_the_weights_while_the_gateway_still_serves_then_pushes(
    fresh_agl_server: AglServerProcess, beside: bool
) -> None:
    with AglClient(fresh_agl_server.url, TEST_KEY) as client:
        publisher, pusher = _publisher(client, fully_async=True, beside=beside)
        publisher.publish(workers=None, version=0)  # type: ignore[arg-type]
        client.resume()
        metrics = publisher.publish(workers=None, version=1)  # type: ignore[arg-type]
    assert pusher.stages == [(0, False), (1, False)]  # the gateway open, serving the old version
    assert [version for version, *_ in pusher.pushes] == [0, 1]
    assert metrics["training/weight_stage_seconds"] > 0.0


def test_publishing_the_served_version_again_does_nothing(fresh_agl_server: AglServerProcess) -> None:
    with AglClient(fresh_agl_server.url, TEST_KEY) as client:
        publisher, pusher = _publisher(client, fully_async=True)
        publisher.publish(workers=None, version=0)  # type: ignore[arg-type]
        metrics = publisher.publish(workers=None, version=0)  # type: ignore[arg-type]  (a step that trained nothing)
        assert not client.proxy_state().paused
    assert pusher.pushes == [(0, True, 0)]
    assert metrics == {}


def test_sync_mode_publish_pushes_drained_and_leaves_the_gateway_paused_for_the_next_step(
    fresh_agl_server: AglServerProcess,
) -> None:
    with AglClient(fresh_agl_server.url, TEST_KEY) as client:
        publisher, pusher = _publisher(client, fully_async=False)
        publisher.publish(workers=None, version=0)  # type: ignore[arg-type]
        client.resume()
        metrics = publisher.publish(workers=None, version=1)  # type: ignore[arg-type]
        assert client.proxy_state().paused
    assert pusher.pushes == [(0, True, 0), (1, True, 0)]
    assert metrics["training/weight_version"] == 1.0


@pytest.mark.parametrize("fully_async", [True, False])
def test_a_version_loaded_beside_the_served_one_is_pushed_and_registered_without_a_pause(
    fresh_agl_server: AglServerProcess, fully_async: bool
) -> None:
    with AglClient(fresh_agl_server.url, TEST_KEY) as client:
        publisher, pusher = _publisher(client, fully_async=fully_async, beside=True)
        publisher.publish(workers=None, version=0)  # type: ignore[arg-type]
        client.resume()
        registered: list[tuple[str, int, bool]] = []
        register = client.register_models

        def observed_register(models: Any) -> Any:
            registered.extend((m.endpoint, m.version, client.proxy_state().paused) for m in models)
            return register(models)

        client.register_models = observed_register  # type: ignore[method-assign]
        deletes: list[bool] = []
        delete = client.delete_models

        def observed_delete() -> None:
            deletes.append(True)
            delete()

        client.delete_models = observed_delete  # type: ignore[method-assign]
        metrics = publisher.publish(workers=None, version=1)  # type: ignore[arg-type]
        paused_after = client.proxy_state().paused
    assert pusher.pushes == [(0, False, 0), (1, False, 0)]  # the gateway stayed open while pushing
    # The same route, updated in place at the new version with the gateway open (the sync modes'
    # gateway is open here only because the test opened it).
    assert registered == [("http://127.0.0.1:9/agl/adapters/current/v1", 1, False)]
    assert deletes == []  # updated in place: no moment without a server
    assert not paused_after
    assert metrics["training/async/gateway_paused_seconds"] == 0.0


class FailingPusher(ReplacesServedWeights):
    """A weight pusher whose push fails on its second endpoint, after the first took the weights."""

    def release(self) -> None:
        return None

    def push(self, workers: Any, version: int) -> dict[str, float]:
        raise WeightPushError(
            f"could not push weights version {version} to the vLLM server at http://second/v1"
        )


class SlowModelServerStandIn:
    """An OpenAI completions endpoint that answers after ``delay_s`` (a stand-in for a vLLM server
    in the middle of a long generation, which the tiny model cannot be made to take). ``received``
    is set when a request arrives."""

    def __init__(self, delay_s: float) -> None:
        self.received = threading.Event()
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                stand_in.received.set()
                time.sleep(delay_s)
                body = json.dumps(
                    {"choices": [{"text": "7", "token_ids": [7], "logprobs": {"token_logprobs": [-0.5]}}]}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                return None

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _call_through_gateway(server: AglServerProcess, rollout_id: str) -> int:
    url = f"{server.url}/proxy/rollout/{rollout_id}/attempt/0/mode/train/openai/v1/completions"
    reply = httpx.post(
        url,
        json={"model": "m", "prompt": [1, 2], "max_tokens": 1},
        headers={"Authorization": f"Bearer {TEST_KEY}"},
    )
    return reply.status_code


def test_a_model_call_in_flight_during_a_publish_finishes_and_is_recorded_with_the_version_that_served_it(
    fresh_agl_server: AglServerProcess,
) -> None:
    upstream = SlowModelServerStandIn(delay_s=1.0)
    version = [0]
    with AglClient(fresh_agl_server.url, TEST_KEY) as client:
        pusher = GatewayObservingPusher(client)
        registrations = lambda: model_registrations(TEST_MODEL_NAME, [upstream.endpoint], version=version[0])  # noqa: E731
        publisher = Publisher(
            client,
            pusher,
            model_name=TEST_MODEL_NAME,
            endpoints=[upstream.endpoint],
            resume=True,
            drain=Drain(30.0, 0.02),
        )
        publisher.publish(workers=None, version=0)  # type: ignore[arg-type]
        client.register_models(registrations())
        client.resume()
        client.create_rollouts(
            [rollout_request({"x": 1}, is_train=True, rollout_config=RolloutConfig(), rollout_id="r1")]
        )
        client.patch_rollout_status("r1", RolloutStatusPatch(state=RolloutState.RUNNING, last_attempt_id="0"))
        statuses: list[int] = []
        in_flight = threading.Thread(
            target=lambda: statuses.append(_call_through_gateway(fresh_agl_server, "r1"))
        )
        in_flight.start()
        assert upstream.received.wait(timeout=30), f"the call never reached the model server: {statuses}"
        version[0] = 1
        metrics = publisher.publish(workers=None, version=1)  # type: ignore[arg-type]
        in_flight.join(timeout=30)
        statuses.append(_call_through_gateway(fresh_agl_server, "r1"))  # a call after the publish
        events = client.get_events("r1", event_type="model_request")
    upstream.close()
    assert statuses == [200, 200]
    assert metrics["training/async/proxy_inflight_at_pause"] == 1.0  # the slow call was in flight
    assert pusher.pushes[-1] == (1, True, 0)  # and had finished before the weights changed
    assert [event.data["server"]["version"] for event in events] == [0, 1]


def test_a_failed_push_leaves_no_endpoint_registered_and_names_the_endpoint(
    fresh_agl_server: AglServerProcess,
) -> None:
    upstream = SlowModelServerStandIn(delay_s=0.0)
    registrations = lambda: model_registrations(TEST_MODEL_NAME, [upstream.endpoint], version=0)  # noqa: E731
    with AglClient(fresh_agl_server.url, TEST_KEY) as client:
        client.register_models(registrations())
        client.resume()
        client.create_rollouts(
            [rollout_request({"x": 1}, is_train=True, rollout_config=RolloutConfig(), rollout_id="r1")]
        )
        client.patch_rollout_status("r1", RolloutStatusPatch(state=RolloutState.RUNNING, last_attempt_id="0"))
        assert _call_through_gateway(fresh_agl_server, "r1") == 200
        publisher = Publisher(
            client,
            FailingPusher(),
            model_name=TEST_MODEL_NAME,
            endpoints=[upstream.endpoint],
            resume=True,
            drain=Drain(10.0, 0.02),
        )
        publisher.published = 0
        with pytest.raises(WeightPushError, match="http://second/v1"):
            publisher.publish(workers=None, version=1)  # type: ignore[arg-type]
        client.resume()  # as the run's stop does
        upstream.received.clear()
        status = _call_through_gateway(fresh_agl_server, "r1")
    upstream.close()
    # No endpoint serves calls that would be recorded under version 0 with version 1's weights.
    assert status != 200
    assert not upstream.received.is_set()


def _drain_from_config(timeout_s: float, poll_interval_s: float) -> Drain:
    config = compose_config(
        [
            f"agentlightning.drain_timeout_seconds={timeout_s}",
            f"agentlightning.drain_poll_interval_seconds={poll_interval_s}",
        ]
    )
    return Drain.from_settings(parse_settings(config).server.drain)


def _slow_call_in_flight(
    server: AglServerProcess, client: AglClient, upstream: SlowModelServerStandIn
) -> None:
    client.register_models(model_registrations(TEST_MODEL_NAME, [upstream.endpoint], version=0))
    client.resume()
    client.create_rollouts(
        [rollout_request({"x": 1}, is_train=True, rollout_config=RolloutConfig(), rollout_id="r1")]
    )
    client.patch_rollout_status("r1", RolloutStatusPatch(state=RolloutState.RUNNING, last_attempt_id="0"))
    call = threading.Thread(target=_call_through_gateway, args=(server, "r1"))
    call.start()
    assert upstream.received.wait(timeout=30), "the call never reached the model server"
    return call


def test_a_drain_gives_up_after_the_configured_timeout_naming_its_key(
    fresh_agl_server: AglServerProcess,
) -> None:
    upstream = SlowModelServerStandIn(delay_s=3.0)
    drain = _drain_from_config(timeout_s=0.5, poll_interval_s=0.1)
    with AglClient(fresh_agl_server.url, TEST_KEY) as client:
        call = _slow_call_in_flight(fresh_agl_server, client, upstream)
        with pytest.raises(
            TimeoutError, match=r"1 model call\(s\) in flight .*agentlightning\.drain_timeout_seconds=0\.5"
        ):
            drain(client, "step 1")
        assert not client.proxy_state().paused  # a run stopping on this leaves the agents free
        call.join(timeout=30)
    upstream.close()


def test_a_drain_asks_for_the_in_flight_count_at_the_configured_interval(
    fresh_agl_server: AglServerProcess,
) -> None:
    upstream = SlowModelServerStandIn(delay_s=2.0)
    drain = _drain_from_config(timeout_s=60, poll_interval_s=0.5)
    with FaultProxy(fresh_agl_server.port) as proxy, AglClient(proxy.url, TEST_KEY) as client:
        call = _slow_call_in_flight(fresh_agl_server, client, upstream)
        proxy.requests.clear()
        metrics = drain(client, "step 1")
        call.join(timeout=30)
    upstream.close()
    polls = proxy.requests.count(("GET", "/proxy/state"))
    # Each poll after the pause's own answer follows a sleep of the interval (0.5 s): at most one per
    # 0.5 s of the drain; the default interval (0.25 s) would give about twice as many.
    assert 2 <= polls <= metrics["training/async/proxy_drain_seconds"] / 0.5 + 0.5
