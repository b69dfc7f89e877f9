"""Several inference servers behind the real agl-server: one that dies leaves the gateway within
seconds, one a push failed on serves nothing until it was caught up, one that comes back is
registered only after its catch-up passed, and the run stops only when none is left.

The model servers here are stand-ins (an HTTP server answering ``/health`` and completions) so a
death is a closed socket and a push a recorded call; ``test_trainer_fleet_on_vllm_cpu.py`` kills
real vLLM servers under a real run.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from typing import Any

import httpx
import pytest

from agl_rollout import AglClient
from agl_rollout.queueing import rollout_request
from agl_testing.agl_server import TEST_KEY, TEST_MODEL_NAME, AglServerProcess
from agl_trainer.serving.drain import Drain
from agl_trainer.serving.errors import WeightPushError
from agl_trainer.serving.fleet import Fleet, NoServerLeftError
from agl_trainer.serving.publisher import Publisher
from agl_trainer.serving.weights import ReplacesServedWeights
from agl_types import RolloutConfig, RolloutState, RolloutStatusPatch

pytestmark = [pytest.mark.server, pytest.mark.timeout(90)]

ROLLOUTS = [f"r{i}" for i in range(12)]


class ModelServerStandIn:
    """``/health`` and ``/v1/completions`` on a loopback port; ``calls`` counts the completions.
    :meth:`close` kills it (connections refused); :meth:`open` brings it back on the same port."""

    def __init__(self, port: int = 0) -> None:
        self.calls = 0
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._answer({} if self.path == "/health" else None)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                stand_in.calls += 1
                self._answer(
                    {"choices": [{"text": "7", "token_ids": [7], "logprobs": {"token_logprobs": [-0.5]}}]}
                )

            def _answer(self, body: dict[str, Any] | None) -> None:
                data = json.dumps(body or {}).encode()
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self._handler = Handler
        self.port = port
        self.open()

    def open(self) -> None:
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), self._handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class RecordingPusher(ReplacesServedWeights):
    """A pusher to external servers (``endpoints``, ``catch_up``) that records what it was asked,
    and fails a push or a catch-up on the endpoints in ``fail_push`` / ``fail_catch_up``."""

    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = tuple(endpoints)
        self.pushed: list[tuple[int, tuple[str, ...]]] = []
        self.caught_up: list[str] = []
        self.fail_push: set[str] = set()
        self.fail_catch_up: set[str] = set()

    def release(self) -> None:
        return None

    def push(self, workers: Any, version: int) -> dict[str, float]:
        self.pushed.append((version, self.endpoints))
        failures = {e: "reload refused" for e in self.endpoints if e in self.fail_push}
        if failures:
            raise WeightPushError(f"version {version} failed on {sorted(failures)}", failures)
        return {"training/weight_version": float(version)}

    def catch_up(self, endpoint: str) -> None:
        self.caught_up.append(endpoint)
        if endpoint in self.fail_catch_up:
            raise WeightPushError(f"{endpoint} answers the probe off", {endpoint: "probe off"})


def _running_rollouts(client: AglClient) -> None:
    client.create_rollouts(
        [
            rollout_request({"x": 1}, is_train=True, rollout_config=RolloutConfig(), rollout_id=r)
            for r in ROLLOUTS
        ]
    )
    for rollout_id in ROLLOUTS:
        client.patch_rollout_status(
            rollout_id, RolloutStatusPatch(state=RolloutState.RUNNING, last_attempt_id="0")
        )


def _call_each_rollout(server: AglServerProcess) -> list[int]:
    """One model call through the gateway per rollout (each pinned to a server by its id)."""
    return [
        httpx.post(
            f"{server.url}/proxy/rollout/{rollout_id}/attempt/0/mode/train/openai/v1/completions",
            json={"model": TEST_MODEL_NAME, "prompt": [1, 2], "max_tokens": 1},
            headers={"Authorization": f"Bearer {TEST_KEY}"},
            timeout=60,
        ).status_code
        for rollout_id in ROLLOUTS
    ]


def _fleet_publisher(
    client: AglClient, servers: list[ModelServerStandIn]
) -> tuple[Publisher, Fleet, RecordingPusher]:
    pusher = RecordingPusher([s.endpoint for s in servers])
    fleet = Fleet(
        client, pusher.endpoints, model_name=TEST_MODEL_NAME, route=pusher.route, catch_up=pusher.catch_up,
        watch_interval_s=0.5,
    )  # fmt: skip
    publisher = Publisher(
        client, pusher, model_name=TEST_MODEL_NAME, endpoints=pusher.endpoints, resume=True,
        drain=Drain(10.0, 0.02), fleet=fleet,
    )  # fmt: skip
    return publisher, fleet, pusher


def test_a_dead_servers_registration_leaves_the_gateway_within_seconds_and_new_calls_go_to_the_live_one(
    fresh_agl_server: AglServerProcess,
) -> None:
    first, second = ModelServerStandIn(), ModelServerStandIn()
    with AglClient(fresh_agl_server.url, TEST_KEY) as client:
        publisher, fleet, _ = _fleet_publisher(client, [first, second])
        publisher.publish(workers=None, version=0)  # type: ignore[arg-type]
        _running_rollouts(client)
        assert _call_each_rollout(fresh_agl_server) == [200] * len(ROLLOUTS)
        assert first.calls and second.calls  # the rollouts' ids spread them over both
        fleet.start()
        try:
            second.close()
            deadline = time.monotonic() + 10
            while fleet.live() != (first.endpoint,) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert fleet.live() == (first.endpoint,)
            first.calls = 0
            statuses = _call_each_rollout(fresh_agl_server)
        finally:
            fleet.stop()
    first.close()
    assert statuses == [200] * len(ROLLOUTS)
    assert first.calls == len(ROLLOUTS)
    assert fleet.metrics() == {"serving/servers_live": 1.0, "serving/server_failures": 1.0}


def test_a_push_that_fails_on_one_of_two_servers_leaves_the_run_on_the_other_until_it_is_caught_up(
    fresh_agl_server: AglServerProcess,
) -> None:
    first, second = ModelServerStandIn(), ModelServerStandIn()
    with AglClient(fresh_agl_server.url, TEST_KEY) as client:
        publisher, _fleet, pusher = _fleet_publisher(client, [first, second])
        publisher.publish(workers=None, version=0)  # type: ignore[arg-type]
        _running_rollouts(client)
        pusher.fail_push = {second.endpoint}
        pusher.fail_catch_up = {second.endpoint}
        metrics = publisher.publish(workers=None, version=1)  # type: ignore[arg-type]
        second.calls = 0
        assert _call_each_rollout(fresh_agl_server) == [200] * len(ROLLOUTS)
        calls_while_out = second.calls
        publisher.publish(workers=None, version=1)  # type: ignore[arg-type]  (the next step's check: its catch-up fails)
        calls_after_failed_catch_up = (_call_each_rollout(fresh_agl_server), second.calls)
        pusher.fail_push = pusher.fail_catch_up = set()
        after = publisher.publish(workers=None, version=2)  # type: ignore[arg-type]
        _call_each_rollout(fresh_agl_server)
    first.close()
    second.close()
    assert metrics["serving/servers_live"] == 1.0
    assert metrics["serving/server_failures"] == 1.0
    assert calls_while_out == 0
    assert calls_after_failed_catch_up == ([200] * len(ROLLOUTS), 0)
    # Caught up (the served version v1, probe checked) before it was registered, then pushed v2.
    assert pusher.caught_up == [second.endpoint, second.endpoint]
    assert pusher.pushed == [
        (0, (first.endpoint, second.endpoint)),
        (1, (first.endpoint, second.endpoint)),
        (2, (first.endpoint, second.endpoint)),
    ]
    assert after["serving/servers_live"] == 2.0
    assert second.calls > 0


def test_a_server_that_comes_back_is_registered_only_after_its_catch_up(
    fresh_agl_server: AglServerProcess,
) -> None:
    first, second = ModelServerStandIn(), ModelServerStandIn()
    with AglClient(fresh_agl_server.url, TEST_KEY) as client:
        publisher, _fleet, pusher = _fleet_publisher(client, [first, second])
        publisher.publish(workers=None, version=0)  # type: ignore[arg-type]
        _running_rollouts(client)
        second.close()
        publisher.publish(workers=None, version=1)  # type: ignore[arg-type]  (the check finds it dead)
        second = ModelServerStandIn(port=second.port)  # restarted, on its port, with unknown weights
        _call_each_rollout(fresh_agl_server)
        calls_before_check = second.calls
        metrics = publisher.publish(workers=None, version=1)  # type: ignore[arg-type]  (caught up, registered)
        _call_each_rollout(fresh_agl_server)
    first.close()
    second.close()
    assert calls_before_check == 0
    assert pusher.caught_up == [second.endpoint]
    assert pusher.pushed == [(0, (first.endpoint, second.endpoint)), (1, (first.endpoint,))]
    assert metrics == {"serving/servers_live": 2.0, "serving/server_failures": 1.0}
    assert second.calls > 0


def test_the_run_stops_when_no_server_is_left_with_one_line_naming_each_and_its_last_error(
    fresh_agl_server: AglServerProcess,
) -> None:
    first, second = ModelServerStandIn(), ModelServerStandIn()
    with AglClient(fresh_agl_server.url, TEST_KEY) as client:
        publisher, _, pusher = _fleet_publisher(client, [first, second])
        publisher.publish(workers=None, version=0)  # type: ignore[arg-type]
        second.close()
        pusher.fail_push = {first.endpoint}
        with pytest.raises(NoServerLeftError) as raised:
            publisher.publish(workers=None, version=1)  # type: ignore[arg-type]
    first.close()
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"no inference server is left: {first.endpoint} (stale): reload refused; ")
    assert f"{second.endpoint} (dead): /health did not answer: " in message
