"""Behaviours of a whole run through ``run_ppo``, the documented library entry: real Ray, verl's
workers on CPU, the real agl-server and its gateway, fake agents.

One run (module fixture) is observed by several tests, each named after one behaviour: one
training step over four GRPO groups of two, then validation over two batches of one:

- x=0: both rollouts earn 1.0 with the same tokens: a zero-advantage group;
- x=1, x=2: one rollout earns 1.0 and the other 0.0 with other tokens: groups with a gradient;
- x=3: both rollouts fail; ``drop_failed_rollouts=true`` drops them from training;
- the first rollout of x=1 to run leaves a model call in flight at the gateway when it finishes
  (a leftover call, as an agent that does not wait for its last call leaves one), served by a
  FAKE upstream that holds the call until the gateway is paused, then 1 s more: the one fault
  a real vLLM cannot produce on demand;
- validation rows x=100 and x=101 earn 0.25 and 0.75.

The weights go to a recording pusher (``run_ppo(weight_pusher=...)``), which asks the gateway how
many calls are in flight at each release and push. The step's metrics are read back from verl's
file logger, as a user of ``trainer.logger=[file]`` reads them.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from agl_testing.agents import AgentBehaviour, FakeAgents
from agl_testing.agl_server import TEST_KEY, TEST_MODEL_NAME, AglServerProcess, require_agl_server
from agl_testing.fake_upstream import HeldCompletions
from agl_testing.http import call
from agl_trainer import run_ppo
from agl_trainer.assembly import compose_config
from agl_trainer.errors import TooManyEmptySteps
from agl_trainer.local.tiny_model import build_tiny_model
from agl_trainer.serving.weights import ReplacesServedWeights
from agl_trainer.verl_glue.cpu_platform import CPU_MODE_OVERRIDES
from agl_trainer.verl_glue.workers import PolicyWorkers

pytestmark = [pytest.mark.verl, pytest.mark.server, pytest.mark.slow]

TRAIN_ROWS = [{"x": i} for i in range(4)]
VAL_ROWS = [{"x": 100}, {"x": 101}]
VAL_REWARDS = {100: 0.25, 101: 0.75}
HOLD_AFTER_PAUSE_S = 1.0


@dataclass
class RecordingPusher(ReplacesServedWeights):
    """A weight pusher that pushes nowhere and records, at each call, the gateway's in-flight count."""

    server: AglServerProcess
    calls: list[tuple[str, int, float]] = field(default_factory=list[tuple[str, int, float]])

    def _inflight(self) -> int:
        return int(call("GET", f"{self.server.url}/proxy/state", key=TEST_KEY).body["inflight"])

    def release(self) -> None:
        self.calls.append(("release", self._inflight(), time.monotonic()))

    def push(self, workers: PolicyWorkers, version: int) -> dict[str, float]:
        self.calls.append((f"push {version}", self._inflight(), time.monotonic()))
        return {}


@dataclass
class Run:
    step: dict[str, Any]
    pushes: list[tuple[str, int, float]]
    upstream: HeldCompletions
    leftover_call_status: list[int]
    left_on_server: list[str]


def _behaviour(server: AglServerProcess, upstream: HeldCompletions, statuses: list[int]) -> Any:
    members: dict[int, int] = {}
    lock = threading.Lock()

    def leave_a_call_in_flight(rollout_id: str) -> None:
        url = f"{server.url}/proxy/rollout/{rollout_id}/attempt/0/mode/train/openai/v1/completions"
        reply = httpx.post(
            url,
            json={"model": TEST_MODEL_NAME, "prompt": "hi"},
            headers={"Authorization": f"Bearer {TEST_KEY}"},
            timeout=180,
        )
        statuses.append(reply.status_code)

    def behaviour(rollout: dict[str, Any]) -> AgentBehaviour:
        x = int(rollout["input"]["x"])
        if x in VAL_REWARDS:
            return AgentBehaviour(reward=VAL_REWARDS[x])
        with lock:
            member = members.get(x, 0)
            members[x] = member + 1
        if x == 3:
            return AgentBehaviour(outcome="failed", reward=None)
        if x == 1 and member == 0:
            threading.Thread(
                target=leave_a_call_in_flight, args=(rollout["rollout_id"],), daemon=True
            ).start()
            assert upstream.received.wait(60), "the leftover call never reached the upstream"
        shift = 0 if x == 0 else member % 2
        return AgentBehaviour(turns=2, reward=1.0 if x == 0 else float(shift), token_shift=shift)

    return behaviour


def _overrides(model_path: Path, server: AglServerProcess, upstream: HeldCompletions, out: Path) -> list[str]:
    return [
        *CPU_MODE_OVERRIDES,
        f"actor_rollout_ref.model.path={model_path}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=3",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.actor.use_dynamic_bsz=false",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.optim.weight_decay=0",
        "data.train_batch_size=4",
        "data.val_batch_size=1",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=1",
        "trainer.save_freq=0",
        "trainer.logger=[file]",
        "trainer.balance_batch=false",
        f"trainer.default_local_dir={out / 'ckpt'}",
        f"agentlightning.agl_base_url={server.url}",
        f"agentlightning.agl_key={TEST_KEY}",
        f"agentlightning.served_model_name={TEST_MODEL_NAME}",
        "agentlightning.poll_interval_seconds=0.05",
        "agentlightning.rollout_timeout_seconds=120",
        "agentlightning.drop_failed_rollouts=true",
        "agentlightning.trace_aggregator.trajectory_max_prompt_length=16",
        "agentlightning.trace_aggregator.trajectory_max_response_length=32",
        f"agentlightning.external_servers.endpoints=[http://{upstream.address}/v1]",
    ]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, ray_cluster: None) -> Iterator[Run]:
    require_agl_server()
    out = tmp_path_factory.mktemp("behaviours")
    model_path = build_tiny_model(out / "model", seed=0)
    server = AglServerProcess()
    server.start()
    gateway_paused = lambda: bool(call("GET", f"{server.url}/proxy/state", key=TEST_KEY).body["paused"])  # noqa: E731
    upstream = HeldCompletions(gateway_paused, hold_after_s=HOLD_AFTER_PAUSE_S).start()
    statuses: list[int] = []
    pusher = RecordingPusher(server)
    metrics_file = out / "metrics.jsonl"
    os.environ["VERL_FILE_LOGGER_PATH"] = str(metrics_file)
    trainer = None
    try:
        config = compose_config(_overrides(model_path, server, upstream, out))
        with FakeAgents(server.url, behaviour=_behaviour(server, upstream, statuses)):
            trainer = run_ppo(config, TRAIN_ROWS, VAL_ROWS, weight_pusher=pusher)
        [step] = [json.loads(line) for line in metrics_file.read_text().splitlines()]
        assert step["step"] == 1
        yield Run(step["data"], pusher.calls, upstream, statuses, server.rollout_ids())
    finally:
        os.environ.pop("VERL_FILE_LOGGER_PATH", None)
        if trainer is not None:
            trainer.shutdown()
        upstream.stop()
        server.stop()


def test_run_ppo_trains_on_in_memory_rows_and_returns_after_the_last_step(run: Run) -> None:
    assert [name for name, _, _ in run.pushes] == ["push 0", "release", "push 1"]
    assert run.step["actor/grad_norm"] > 0
    assert run.left_on_server == []


def test_no_weight_push_while_a_model_call_is_in_flight(run: Run) -> None:
    # Nothing touched the servers' memory or weights while the leftover call was in flight...
    after_collection = run.pushes[1:]
    assert [(name, inflight) for name, inflight, _ in after_collection] == [("release", 0), ("push 1", 0)]
    [answered_at] = run.upstream.answered_at
    assert all(at > answered_at for _, _, at in after_collection)
    # ...though it was in flight when collection ended and the drain waited for it.
    assert run.step["training/async/proxy_inflight_at_pause"] == 1.0
    assert run.step["training/async/proxy_drain_seconds"] >= HOLD_AFTER_PAUSE_S


def test_failed_rollouts_are_counted_and_dropped_from_training_when_configured(run: Run) -> None:
    assert run.step["training/n_rollouts_failed"] == 2
    assert run.step["training/n_sample_collected"] == 6  # 8 rollouts, x=3's two dropped
    assert run.step["training/n_sample_trained"] == 6


def test_zero_advantage_groups_are_counted_in_the_step_metrics(run: Run) -> None:
    assert run.step["training/n_groups"] == 3
    assert run.step["training/n_zero_adv_groups"] == 1  # x=0; x=1 and x=2 have a gradient


def test_validation_metrics_aggregate_every_validation_batch(run: Run) -> None:
    assert run.step["val/n_rollouts"] == 2  # two batches of one
    assert run.step["val/reward"] == pytest.approx(0.5)  # (0.25 + 0.75) / 2


def test_a_run_whose_rollouts_all_fail_warns_each_step_and_stops_after_max_empty_steps(
    tmp_path: Path, ray_cluster: None, caplog: pytest.LogCaptureFixture
) -> None:
    require_agl_server()
    model_path = build_tiny_model(tmp_path / "model", seed=0)
    server = AglServerProcess()
    server.start()
    upstream = HeldCompletions().start()
    # verl's file logger without VERL_FILE_LOGGER_PATH would write into the working directory.
    logged = [
        o for o in _overrides(model_path, server, upstream, tmp_path) if not o.startswith("trainer.logger=")
    ]
    overrides = [
        *logged,
        "trainer.logger=[console]",
        "trainer.total_training_steps=5",
        "trainer.test_freq=0",
        "agentlightning.max_empty_steps=2",
    ]
    try:
        with (
            FakeAgents(server.url, behaviour=AgentBehaviour(outcome="failed", reward=None)),
            caplog.at_level(logging.WARNING, logger="agl_trainer"),
            pytest.raises(TooManyEmptySteps) as stopped,
        ):
            run_ppo(compose_config(overrides), TRAIN_ROWS, VAL_ROWS, weight_pusher=RecordingPusher(server))
    finally:
        upstream.stop()
        server.stop()
    assert str(stopped.value).startswith("2 steps in a row trained nothing (the last, step 2")
    warnings = [r.getMessage() for r in caplog.records if "rollouts failed" in r.getMessage()]
    assert warnings == [
        "step 1: all 8 rollouts failed; the first error: fake agent failed on purpose",
        "step 2: all 8 rollouts failed; the first error: fake agent failed on purpose",
    ]
