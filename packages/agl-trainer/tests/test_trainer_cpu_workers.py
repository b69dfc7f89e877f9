"""verl's actor and ref workers on CPU in real Ray workers, built without verl's rollout workers.

One module-scoped cluster (Ray with 2 CPUs, one colocated worker process holding actor and ref)
serves every test; the tiny model is built in a temporary folder.
"""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from verl import DataProto

from agl_trainer.local.tiny_model import build_tiny_model
from agl_trainer.verl_glue.cpu_platform import CPU_MODE_OVERRIDES
from agl_trainer.verl_glue.workers import PolicyWorkers, build_policy_workers, compose_verl_config

pytestmark = [pytest.mark.verl, pytest.mark.slow]

PROMPT_LEN, RESPONSE_LEN, ROWS = 8, 12, 4
ADVANTAGES = (1.0, -1.0, 0.5, -0.5)


def tiny_overrides(model_path: Path) -> list[str]:
    return [
        *CPU_MODE_OVERRIDES,
        f"actor_rollout_ref.model.path={model_path}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={ROWS}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={ROWS}",
        "actor_rollout_ref.actor.use_dynamic_bsz=false",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        # agl's loss that needs the most wiring: the setup hook's registration, and each row's
        # rollout_index carried into the loss by the worker's wrapped loss function.
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo_per_rollout",
        "actor_rollout_ref.actor.use_kl_loss=true",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={ROWS}",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={ROWS}",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "algorithm.adv_estimator=grpo",  # verl's default, gae, would also build a critic
    ]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("cpu_workers") / "model", seed=0)


@pytest.fixture(scope="module")
def policy(model_path: Path, ray_cluster: None) -> Iterator[PolicyWorkers]:
    workers = build_policy_workers(compose_verl_config(tiny_overrides(model_path)))
    yield workers
    workers.shutdown()


def rollout_batch() -> DataProto:
    """Four rows: row 0 left-padded prompt (3 pads), row 1 right-padded response (5 valid tokens)."""
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 400, (ROWS, PROMPT_LEN), generator=generator)
    responses = torch.randint(3, 400, (ROWS, RESPONSE_LEN), generator=generator)
    attention_mask = torch.ones(ROWS, PROMPT_LEN + RESPONSE_LEN, dtype=torch.long)
    attention_mask[0, :3] = 0
    attention_mask[1, PROMPT_LEN + 5 :] = 0
    prompts[0, :3] = 0
    responses[1, 5:] = 0
    return DataProto.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
            "response_mask": attention_mask[:, PROMPT_LEN:],
        }
    )


def hf_model(model_path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="sdpa", dtype=torch.float32)


def hf_log_probs(model_path: Path, batch: DataProto) -> torch.Tensor:
    """Log-probs of the response tokens under the HF model at ``model_path``, (B, R), 0 on padding."""
    return model_log_probs(hf_model(model_path), batch)


def model_log_probs(model: Any, batch: DataProto) -> torch.Tensor:
    """Log-probs of the response tokens under ``model`` (transformers or PEFT), (B, R), 0 on padding."""
    with torch.no_grad():
        logits = model(
            input_ids=batch.batch["input_ids"],
            attention_mask=batch.batch["attention_mask"],
            position_ids=batch.batch["position_ids"],
        ).logits
    log_probs = torch.log_softmax(logits[:, PROMPT_LEN - 1 : -1], dim=-1)
    picked = log_probs.gather(-1, batch.batch["responses"].unsqueeze(-1)).squeeze(-1)
    return picked * batch.batch["response_mask"]


@pytest.fixture(scope="module")
def before_update(policy: PolicyWorkers) -> DataProto:
    return policy.compute_log_prob(rollout_batch())


def update(policy: PolicyWorkers, before: DataProto) -> dict[str, list[float]]:
    """One update of ``policy`` on :func:`rollout_batch` with :data:`ADVANTAGES` (``before``: its old log-probs)."""
    batch = rollout_batch()
    batch = batch.union(before).union(policy.compute_ref_log_prob(batch))
    batch.batch["advantages"] = torch.tensor(ADVANTAGES).unsqueeze(-1) * batch.batch["response_mask"]
    batch.batch["rollout_index"] = torch.tensor([0, 0, 1, 1])
    return policy.update_actor(batch)


@pytest.fixture(scope="module")
def update_metrics(policy: PolicyWorkers, before_update: DataProto) -> dict[str, list[float]]:
    return update(policy, before_update)


def test_workers_resolve_gspo_per_rollout_to_the_agl_algos_loss(policy: PolicyWorkers) -> None:
    # Registered inside the worker by the setup hook, not inherited from the driver.
    assert policy.describe_policy_loss() == ["agl_algos.loss.compute_policy_loss_gspo_per_rollout"]
    policy.check_policy_loss("gspo_per_rollout")


def test_an_update_without_rollout_index_fails_saying_the_loss_needs_it(
    policy: PolicyWorkers, before_update: DataProto
) -> None:
    batch = rollout_batch()
    batch = batch.union(before_update).union(policy.compute_ref_log_prob(batch))
    batch.batch["advantages"] = torch.tensor(ADVANTAGES).unsqueeze(-1) * batch.batch["response_mask"]
    with pytest.raises(Exception, match="gspo_per_rollout needs each row's rollout index"):
        policy.update_actor(batch)


def test_actor_log_probs_match_transformers_on_the_initial_weights(
    policy: PolicyWorkers, model_path: Path, before_update: DataProto
) -> None:
    expected = hf_log_probs(model_path, rollout_batch())
    actual = before_update.batch["old_log_probs"] * rollout_batch().batch["response_mask"]
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_ref_log_probs_equal_actor_log_probs_before_any_update(
    policy: PolicyWorkers, before_update: DataProto
) -> None:
    ref = policy.compute_ref_log_prob(rollout_batch()).batch["ref_log_prob"]
    mask = rollout_batch().batch["response_mask"]
    torch.testing.assert_close(ref * mask, before_update.batch["old_log_probs"] * mask)


def test_first_update_reports_the_token_sum_policy_loss(
    update_metrics: dict[str, list[float]],
) -> None:
    # At the first update every rollout's ratio is 1, so the loss is -sum(A) over valid tokens (one
    # rank): 12 * 1 + 5 * -1 + 12 * 0.5 + 12 * -0.5 = 7, whereas verl's vanilla token-mean gives -7/41.
    assert update_metrics["actor/pg_loss"] == [pytest.approx(-7.0, abs=1e-5)]


def test_update_changes_the_actor_but_not_the_ref(
    policy: PolicyWorkers, before_update: DataProto, update_metrics: dict[str, list[float]]
) -> None:
    mask = rollout_batch().batch["response_mask"]
    after = policy.compute_log_prob(rollout_batch()).batch["old_log_probs"] * mask
    ref = policy.compute_ref_log_prob(rollout_batch()).batch["ref_log_prob"] * mask
    assert (after - before_update.batch["old_log_probs"] * mask).abs().max() > 1e-2
    torch.testing.assert_close(ref, before_update.batch["old_log_probs"] * mask)


def test_saved_hf_weights_load_in_transformers_and_match_the_updated_actor(
    policy: PolicyWorkers, tmp_path: Path, update_metrics: dict[str, list[float]]
) -> None:
    saved = policy.save_hf_weights(tmp_path / "pushed")
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        item.name for item in saved.iterdir()
    }
    mask = rollout_batch().batch["response_mask"]
    actor = policy.compute_log_prob(rollout_batch()).batch["old_log_probs"] * mask
    torch.testing.assert_close(hf_log_probs(saved, rollout_batch()), actor, atol=1e-4, rtol=1e-4)


def test_the_probe_log_probs_are_the_actors_own_of_each_token_given_its_prefix(
    policy: PolicyWorkers, tmp_path: Path
) -> None:
    probe = [5, 17, 3, 250, 42, 9]
    held = hf_model(policy.save_hf_weights(tmp_path / "held"))  # the weights the actor holds now
    with torch.no_grad():
        logits = held(input_ids=torch.tensor([probe])).logits[0, :-1]
    expected = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(probe[1:]).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(torch.tensor(policy.probe_logprobs(probe)), expected, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def lora_policy(model_path: Path, ray_cluster: None) -> Iterator[PolicyWorkers]:
    lora = [
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.model.target_modules=all-linear",
    ]
    workers = build_policy_workers(compose_verl_config([*tiny_overrides(model_path), *lora]))
    yield workers
    workers.shutdown()


def test_a_lora_actor_trains_its_adapter_alone_and_the_saved_adapter_reproduces_it(
    lora_policy: PolicyWorkers, model_path: Path, tmp_path: Path
) -> None:
    mask = rollout_batch().batch["response_mask"]
    before = lora_policy.compute_log_prob(rollout_batch())
    update(lora_policy, before)
    saved = lora_policy.save_lora_adapter(tmp_path / "adapter")
    after = lora_policy.compute_log_prob(rollout_batch()).batch["old_log_probs"] * mask
    tensors = load_file(saved / "adapter_model.safetensors")
    assert {item.name for item in saved.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    assert all(name.endswith((".lora_A.weight", ".lora_B.weight")) for name in tensors)
    assert (after - before.batch["old_log_probs"] * mask).abs().max() > 1e-2  # the update moved the actor
    # The model it started from plus the saved adapter is the actor: only the adapter trained.
    with_adapter = PeftModel.from_pretrained(hf_model(model_path), saved)
    torch.testing.assert_close(model_log_probs(with_adapter, rollout_batch()), after, atol=1e-4, rtol=1e-4)
