"""The local agent runner against the real agl-server, with a scripted model server upstream.

The upstream is a small HTTP server that answers ``/v1/completions`` like vLLM does with
``return_token_ids`` (fixed response tokens, fixed log-probs), so these tests need no vLLM;
``test_trainer_local_vllm.py`` repeats the multi-turn check with the real one.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from agl_rollout import AglClient
from agl_testing.requirements import missing_requirement
from agl_trainer.local import (
    AgentContext,
    AglServer,
    AglServerApi,
    DigitToolTask,
    LocalAgentRunner,
    RunnerStats,
    agl_server_spec,
    existing_tool_env,
    start_agl_server,
    tiny_model,
)
from agl_types import ModelRegistration, Rollout, RolloutCreate

pytestmark = pytest.mark.server

_STUB_TOKENS = [10, 11, 12]
_STUB_LOGPROBS = [-0.5, -1.0, -1.5]


def server_python() -> Path:
    env = existing_tool_env(agl_server_spec())
    if env is None:
        missing_requirement("no agl-server tool environment; run agl-trainer once to provision it")
    return env.python


class _StubModelServer:
    """Records each request body and answers like vLLM's completions endpoint."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append(body)
                choice = {
                    "index": 0,
                    "text": "abc",
                    "token_ids": _STUB_TOKENS,
                    "prompt_token_ids": body["prompt"],
                    "logprobs": {"token_logprobs": _STUB_LOGPROBS} if body.get("logprobs") else None,
                    "finish_reason": "length",
                }
                payload = json.dumps({"choices": [choice], "usage": {"completion_tokens": 3}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AglServer]:
    with start_agl_server(server_python(), tmp_path_factory.mktemp("agl-server")) as running:
        yield running


@pytest.fixture
def api(server: AglServer) -> Iterator[AglServerApi]:
    with AglServerApi(server.url, server.key) as client:
        yield client


@pytest.fixture
def client(server: AglServer) -> Iterator[AglClient]:
    """The trainer's own client of the server, to create rollouts and read what the runner did."""
    with AglClient(server.url, server.key) as trainer_client:
        yield trainer_client


@pytest.fixture
def stub(client: AglClient, server: AglServer) -> Iterator[_StubModelServer]:
    upstream = _StubModelServer()
    client.register_models(
        [ModelRegistration(model=server.model_name, endpoint=upstream.endpoint, version=3)]
    )
    yield upstream
    client.delete_models()
    upstream.close()


def _create(client: AglClient, items: list[dict[str, Any]]) -> list[str]:
    created = client.create_rollouts([RolloutCreate(rollout_id=uuid.uuid4().hex, **item) for item in items])
    return [rollout.rollout_id for rollout in created]


def _wait_terminal(client: AglClient, rollout_ids: list[str], timeout: float = 60.0) -> list[Rollout]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rollouts = [client.get_rollout(rid).rollout for rid in rollout_ids]
        if all(r.state in ("succeeded", "failed") for r in rollouts):
            return rollouts
        time.sleep(0.1)
    raise AssertionError(f"rollouts {rollout_ids} did not finish within {timeout} s")


def _run(
    api: AglServerApi, client: AglClient, agent: Callable[[AgentContext], float], items: list[dict[str, Any]]
) -> tuple[list[Rollout], RunnerStats]:
    with LocalAgentRunner(api, agent, poll_interval=0.05) as runner:
        return _wait_terminal(client, _create(client, items)), runner.stats


def test_runner_posts_reward_and_marks_rollout_succeeded(api: AglServerApi, client: AglClient) -> None:
    [rollout], stats = _run(api, client, lambda _ctx: 0.75, [{"input": {"q": 1}}])
    assert rollout.state == "succeeded"
    assert rollout.status.last_attempt_id == "0"
    events = client.get_events(rollout.rollout_id)
    assert [(e.event_type, e.attempt_id, e.data) for e in events] == [
        ("reward", "0", {"value": 0.75, "source": "agent"})
    ]
    assert (stats.succeeded, stats.failed, stats.stopped) == (1, 0, 0)


def test_runner_passes_input_and_is_train_to_agent(api: AglServerApi, client: AglClient) -> None:
    seen: list[tuple[Any, bool]] = []

    def agent(ctx: AgentContext) -> float:
        seen.append((ctx.input, ctx.is_train))
        return 0.0

    _run(api, client, agent, [{"input": {"q": "val"}, "is_train": False}])
    assert seen == [({"q": "val"}, False)]


def test_runner_marks_failed_with_error_message_when_agent_raises(
    api: AglServerApi, client: AglClient
) -> None:
    def agent(_ctx: AgentContext) -> float:
        raise RuntimeError("tool crashed")

    [rollout], stats = _run(api, client, agent, [{"input": None}])
    assert rollout.state == "failed"
    assert rollout.status.error_message == "RuntimeError: tool crashed"
    assert client.get_events(rollout.rollout_id) == []
    assert (stats.succeeded, stats.failed, stats.stopped) == (0, 1, 0)


def test_runner_fails_rollout_when_no_model_is_registered(api: AglServerApi, client: AglClient) -> None:
    client.delete_models()

    def agent(ctx: AgentContext) -> float:
        ctx.model.complete([1, 2], max_tokens=1)
        return 1.0

    [rollout], _ = _run(api, client, agent, [{"input": None}])
    assert rollout.state == "failed"
    assert "503 Service Unavailable" in str(rollout.status.error_message)


def test_runner_runs_at_most_workers_rollouts_at_once(api: AglServerApi, client: AglClient) -> None:
    release = threading.Event()

    def agent(_ctx: AgentContext) -> float:
        release.wait(30)
        return 1.0

    with LocalAgentRunner(api, agent, workers=2, poll_interval=0.05) as runner:
        ids = _create(client, [{"input": i} for i in range(5)])
        deadline = time.monotonic() + 60
        while len(api.list_rollouts(["running"])) < 2:
            assert time.monotonic() < deadline, "the runner did not start two rollouts within 60 s"
            time.sleep(0.05)
        time.sleep(0.5)  # a window for a third one to start, were the bound not kept (10 polls)
        states = sorted(client.get_rollout(rid).rollout.state for rid in ids)
        release.set()
        finished = _wait_terminal(client, ids)
    assert states == ["queuing", "queuing", "queuing", "running", "running"]
    assert [r.state for r in finished] == ["succeeded"] * 5
    assert runner.stats.succeeded == 5


def test_toy_agent_turns_extend_prefix_in_recorded_events(
    api: AglServerApi, client: AglClient, stub: _StubModelServer, tmp_path: Path
) -> None:
    task = DigitToolTask.from_model(tiny_model.build_tiny_model(tmp_path / "m"), max_tokens_per_turn=3)
    [rollout], _ = _run(api, client, task, [{"input": {"prompt": "Numbers:"}}])
    assert rollout.state == "succeeded"
    triplets = client.get_events(rollout.rollout_id, triplet=True)
    assert [e.event_type for e in triplets] == ["model_request", "model_request", "reward"]
    first, second, reward = (e.data for e in triplets)
    observation = task.encode(task.observation(_STUB_TOKENS))
    assert first["prompt_token_ids"] == task.encode("Numbers:")
    assert second["prompt_token_ids"] == first["prompt_token_ids"] + _STUB_TOKENS + observation
    assert first["response_token_ids"] == second["response_token_ids"] == _STUB_TOKENS
    assert first["response_log_probs"] == _STUB_LOGPROBS
    assert first["server"] == {"model": "agl-local-policy", "version": 3}
    assert reward == {"value": task.reward(_STUB_TOKENS * 2), "source": "agent"}


def test_gateway_adds_train_params_to_agent_requests(
    api: AglServerApi, client: AglClient, stub: _StubModelServer
) -> None:
    def agent(ctx: AgentContext) -> float:
        ctx.model.complete([5, 6], max_tokens=3)
        return 0.0

    _run(api, client, agent, [{"input": None, "is_train": True}, {"input": None, "is_train": False}])
    by_mode = {bool(body.get("logprobs")): body for body in stub.requests}
    assert by_mode[True] == {
        "prompt": [5, 6],
        "max_tokens": 3,
        "return_token_ids": True,
        "model": "agl-local-policy",
        "temperature": 1.0,
        "logprobs": True,
    }
    assert by_mode[False] == {
        "prompt": [5, 6],
        "max_tokens": 3,
        "return_token_ids": True,
        "model": "agl-local-policy",
        "temperature": 0.7,
    }


def _one_call_agent(ctx: AgentContext) -> float:
    """One model call of 3 tokens; the reward is how many came back."""
    return float(len(ctx.model.complete([1], max_tokens=3).token_ids))


def _claim_one_while_paused(client: AglClient) -> str:
    """Create one rollout and wait until the running runner has claimed it (the gateway is paused)."""
    [created] = _create(client, [{"input": None}])
    deadline = time.monotonic() + 60
    while client.get_rollout(created).rollout.state != "running":
        assert time.monotonic() < deadline, "the runner did not claim the rollout within 60 s"
        time.sleep(0.05)
    return created


def test_runner_waits_out_a_paused_gateway(
    api: AglServerApi, client: AglClient, stub: _StubModelServer
) -> None:
    client.pause("test", retry_after_seconds=1)
    try:
        with LocalAgentRunner(api, _one_call_agent, poll_interval=0.05) as runner:
            created = _claim_one_while_paused(client)
            time.sleep(1.5)
            requests_while_paused = len(stub.requests)
            client.resume()
            [rollout] = _wait_terminal(client, [created])
    finally:
        client.resume()
    assert requests_while_paused == 0
    assert rollout.state == "succeeded"
    assert client.get_events(rollout.rollout_id, triplet=True)[-1].data["value"] == 3.0
    assert runner.stats.succeeded == 1


def test_stopping_runner_fails_an_agent_waiting_on_a_paused_gateway(
    api: AglServerApi, client: AglClient, stub: _StubModelServer
) -> None:
    client.pause("test", retry_after_seconds=60)
    try:
        with LocalAgentRunner(api, _one_call_agent, poll_interval=0.05) as runner:
            created = _claim_one_while_paused(client)
        [rollout] = _wait_terminal(client, [created])
    finally:
        client.resume()
    assert stub.requests == []
    assert rollout.state == "failed"
    assert rollout.status.error_message == (
        "RunnerStoppedError: the local runner stopped while the gateway was paused"
    )
    assert (runner.stats.failed, runner.stats.stopped) == (0, 1)


def test_an_agent_failing_after_the_runner_stopped_is_counted_stopped_and_logs_nothing(
    api: AglServerApi, client: AglClient, caplog: pytest.LogCaptureFixture
) -> None:
    """A run that ends on an error stops the runner without waiting: its agents then fail on a
    closed client or a stopped server, which is no news to print under the run's own error."""
    started, release = threading.Event(), threading.Event()

    def agent(_context: AgentContext) -> float:
        started.set()
        release.wait(30)
        raise RuntimeError("agl-server is gone")

    runner = LocalAgentRunner(api, agent, poll_interval=0.05).start()
    [created] = _create(client, [{"input": {}}])
    assert started.wait(30)
    with caplog.at_level(logging.WARNING, logger="agl_trainer.local.runner"):
        runner.stop(wait=False)
        release.set()
        [rollout] = _wait_terminal(client, [created])
        deadline = time.monotonic() + 10
        while runner.stats.stopped == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert (rollout.state, runner.stats.failed, runner.stats.stopped) == ("failed", 0, 1)
    assert caplog.messages == []
