"""Vision-language rows on the trainer side: the adapter's images and mrope positions reach verl's
engine input intact, give a tiny Qwen2-VL the same forward as the model call they record, and
verl's FSDP actor (CPU, real Ray workers) computes and trains on them."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from verl import DataProto

from agl_adapter import RolloutAdapter, load_image
from agl_testing.routes import succeeded_rollout
from agl_testing.vision import placeholder, png_data_url, tiny_vl_model, tiny_vl_processor
from agl_trainer.assembly import load_processor
from agl_trainer.local.tiny_model import build_tiny_model
from agl_trainer.verl_glue.cpu_platform import CPU_MODE_OVERRIDES
from agl_trainer.verl_glue.workers import (
    PolicyWorkers,
    build_policy_workers,
    compose_verl_config,
    no_padding_batch,
)
from agl_types import CompletedRollout, Triplet

pytestmark = pytest.mark.verl

PROMPT_LEN, RESPONSE_LEN = 16, 4


@pytest.fixture(scope="module")
def processor() -> Any:
    return tiny_vl_processor()


def _calls(processor: Any) -> list[CompletedRollout]:
    """Three recorded calls: one image, two images, none."""
    one, two = [png_data_url(2, 2)], [png_data_url(1, 2, shade=1), png_data_url(3, 1, shade=2)]
    calls = [
        Triplet(
            prompt_token_ids=[5, *placeholder(processor, 2, 2), 6],
            response_token_ids=[7, 8, 9],
            image_urls=one,
        ),
        Triplet(
            prompt_token_ids=[*placeholder(processor, 1, 2), 11, *placeholder(processor, 3, 1)],
            response_token_ids=[12, 13, 14, 15],
            image_urls=two,
        ),
        Triplet(prompt_token_ids=[20, 21, 22], response_token_ids=[23, 24]),
    ]
    return [succeeded_rollout([call], rollout_id=f"r{k}", sample=k) for k, call in enumerate(calls)]


def _call_inputs(processor: Any, rollout: CompletedRollout) -> dict[str, Any]:
    """The model inputs of a rollout's one recorded call, as the processor gives them (no positions:
    the model computes its own rope index)."""
    call = rollout.triplets[0]
    ids = torch.tensor([[*call.prompt_token_ids, *call.response_token_ids]])
    inputs: dict[str, Any] = {"input_ids": ids, "mm_token_type_ids": (ids == processor.image_token_id).long()}
    if call.image_urls:
        images = [load_image(url) for url in call.image_urls]
        inputs |= processor.image_processor(images=images, return_tensors="pt")
    return inputs


def _adapter(processor: Any) -> RolloutAdapter:
    return RolloutAdapter(
        max_prompt_length=PROMPT_LEN,
        max_response_length=RESPONSE_LEN,
        pad_token_id=0,
        trace_aggregator_level="transition",
        processor=processor,
    )


def test_images_and_mrope_positions_follow_input_ids_into_verls_no_padding_layout(processor: Any) -> None:
    proto, _ = _adapter(processor).get_train_data_batch(_calls(processor))
    assert isinstance(proto, DataProto)
    padded_positions = proto.batch["position_ids"]
    inputs = proto.non_tensor_batch["multi_modal_inputs"]
    td = no_padding_batch(proto, temperature=1.0)
    for row, mask in enumerate(proto.batch["attention_mask"].bool()):
        assert torch.equal(td["position_ids"][row], padded_positions[row][:, mask])
        assert len(td["input_ids"][row]) == int(mask.sum())
    engine_inputs = td["multi_modal_inputs"]
    assert engine_inputs[2] is None
    for row in (0, 1):
        assert engine_inputs[row].keys() == inputs[row].keys() == {"pixel_values", "image_grid_thw"}
        for key, value in inputs[row].items():
            assert torch.equal(engine_inputs[row][key], value)


@torch.no_grad()
def test_an_adapter_row_gives_the_model_the_same_forward_as_the_call_it_records(processor: Any) -> None:
    """The row's tokens, (4, L) positions and vision tensors, fed as verl's engine feeds them, give
    the logits the model computes for the call from the processor's inputs and its own rope index."""
    model = tiny_vl_model(processor)
    rollouts = _calls(processor)
    batch, _ = _adapter(processor).build_batch(rollouts)
    assert batch.multi_modal_inputs is not None
    for row, rollout in enumerate(rollouts):
        expected = model(**_call_inputs(processor, rollout)).logits
        mask = batch.attention_mask[row].bool()
        actual = model(
            input_ids=batch.input_ids[row][mask][None],
            position_ids=batch.position_ids[row][:, mask][:, None],
            **(batch.multi_modal_inputs[row] or {}),
        ).logits
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


ADVANTAGES = (1.0, 0.5, -1.0)


@pytest.fixture(scope="module")
def vl_model_path(processor: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2-VL saved as verl loads a model: weights, config, tokenizer, image processor."""
    path = tmp_path_factory.mktemp("vision") / "model"
    tiny_vl_model(processor).save_pretrained(path)
    processor.tokenizer.save_pretrained(path)
    processor.image_processor.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def vl_policy(vl_model_path: Path, ray_cluster: None) -> Iterator[PolicyWorkers]:
    rows = len(ADVANTAGES)
    workers = build_policy_workers(
        compose_verl_config(
            [
                *CPU_MODE_OVERRIDES,
                f"actor_rollout_ref.model.path={vl_model_path}",
                "actor_rollout_ref.model.enable_gradient_checkpointing=false",
                f"actor_rollout_ref.actor.ppo_mini_batch_size={rows}",
                f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={rows}",
                "actor_rollout_ref.actor.use_dynamic_bsz=false",
                "actor_rollout_ref.actor.optim.lr=1e-2",
                "actor_rollout_ref.actor.policy_loss.loss_mode=gspo_per_rollout",
                "actor_rollout_ref.rollout.name=vllm",
                f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={rows}",
                "trainer.n_gpus_per_node=1",
                "trainer.nnodes=1",
                "algorithm.adv_estimator=grpo",
            ]
        )
    )
    yield workers
    workers.shutdown()


@torch.no_grad()
def _call_log_probs(processor: Any, rollout: CompletedRollout) -> torch.Tensor:
    """The tiny model's log-probs of a call's response tokens, from the call's own processor inputs."""
    call = rollout.triplets[0]
    logits = tiny_vl_model(processor)(**_call_inputs(processor, rollout)).logits[
        0, len(call.prompt_token_ids) - 1 : -1
    ]
    picked = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(call.response_token_ids)[:, None])
    return picked[:, 0]


@pytest.fixture(scope="module")
def image_batch(processor: Any) -> DataProto:
    proto, _ = _adapter(processor).get_train_data_batch(_calls(processor))
    assert isinstance(proto, DataProto)
    return proto


@pytest.fixture(scope="module")
def initial_log_probs(vl_policy: PolicyWorkers, image_batch: DataProto) -> DataProto:
    """The actor's log-probs before any update: every test that updates the shared actor asks for
    them first, so they hold whatever order the tests run in."""
    return vl_policy.compute_log_prob(image_batch)


@pytest.mark.slow
def test_verls_actor_gives_image_rows_the_log_probs_of_the_calls_they_record(
    processor: Any, initial_log_probs: DataProto
) -> None:
    log_probs = initial_log_probs.batch["old_log_probs"]
    for row, rollout in enumerate(_calls(processor)):
        expected = _call_log_probs(processor, rollout)
        torch.testing.assert_close(log_probs[row, : len(expected)], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_an_update_on_image_rows_trains_with_the_exact_first_step_loss(
    vl_policy: PolicyWorkers, image_batch: DataProto, initial_log_probs: DataProto
) -> None:
    batch = image_batch.union(initial_log_probs)
    batch.batch["advantages"] = torch.tensor(ADVANTAGES)[:, None] * batch.batch["response_mask"]
    batch.batch["rollout_index"] = torch.arange(len(ADVANTAGES))
    metrics = vl_policy.update_actor(batch)
    # Ratio 1 at the first update: the token-sum loss is -sum(A) over valid tokens, 3 + 4 * 0.5 - 2 = 3.
    assert metrics["actor/pg_loss"] == [pytest.approx(-3.0, abs=1e-5)]
    after = vl_policy.compute_log_prob(image_batch).batch["old_log_probs"]
    changed = (after - initial_log_probs.batch["old_log_probs"]).abs() * image_batch.batch["response_mask"]
    assert (changed.amax(dim=-1) > 1e-4).all()


def test_a_text_model_has_no_processor(tmp_path: Path) -> None:
    assert load_processor(str(build_tiny_model(tmp_path / "model"))) is None


def test_a_vision_model_whose_processor_does_not_load_stops_the_start_naming_the_key(
    vl_model_path: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "model"
    shutil.copytree(vl_model_path, broken)
    (broken / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(
        RuntimeError,
        match=rf"actor_rollout_ref.model.path={broken} is a vision-language model, but its HF processor did not load",
    ):
        load_processor(str(broken))
