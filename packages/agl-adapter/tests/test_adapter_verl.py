"""The DataProto conversion against the real verl (skipped where verl is not installed)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from agl_adapter import RolloutAdapter
from agl_testing.requirements import import_optional
from agl_testing.routes import npy_payload, succeeded_rollout
from agl_types import CompletedRollout, RolloutState, Triplet

verl = import_optional("verl")
pytestmark = pytest.mark.verl

from verl import DataProto  # noqa: E402


def _rollouts() -> list[CompletedRollout]:
    def rollout(i: int, triplets: list[Triplet]) -> CompletedRollout:
        return CompletedRollout(
            rollout_id=f"r{i}",
            data_id=f"d{i // 2}",
            step=0,
            sample_idx_in_step=i,
            enqueue_time=0.0,
            final_reward=float(i),
            triplets=triplets,
            rollout_state=RolloutState.SUCCEEDED,
        )

    merged = [
        Triplet(prompt_token_ids=[1, 2], response_token_ids=[3], response_log_probs=[-0.5]),
        Triplet(prompt_token_ids=[1, 2, 3, 8], response_token_ids=[4, 5], response_log_probs=[-0.1, -0.2]),
    ]
    single = [Triplet(prompt_token_ids=[7], response_token_ids=[6], response_log_probs=[-1.0])]
    return [rollout(0, merged), rollout(1, single), rollout(2, single), rollout(3, merged)]


@pytest.mark.parametrize("level", ["trajectory", "transition"])
def test_get_train_data_batch_returns_a_consistent_data_proto(level: str) -> None:
    adapter = RolloutAdapter(
        max_prompt_length=4, max_response_length=6, pad_token_id=0, trace_aggregator_level=level
    )
    proto, _ = adapter.get_train_data_batch(_rollouts())
    assert isinstance(proto, DataProto)
    proto.check_consistency()
    n = len(proto)
    assert proto.batch.batch_size == torch.Size([n])
    expected_keys = {
        "prompts",
        "responses",
        "input_ids",
        "attention_mask",
        "position_ids",
        "response_mask",
        "is_drop_mask",
        "token_level_scores",
        "rollout_log_probs",
        "response_weight_versions",
    }
    assert set(proto.batch.keys()) == expected_keys
    non_tensor = {"data_id_list", "rollout_id_list", "weight_version_min", "weight_version_max"} | (
        {"turn_index_list"} if level == "transition" else set()
    )
    assert set(proto.non_tensor_batch) == non_tensor
    assert all(isinstance(v, np.ndarray) and len(v) == n for v in proto.non_tensor_batch.values())
    assert proto.meta_info == {}


def test_routed_experts_reach_the_data_proto_as_uint8_beside_input_ids() -> None:
    routes = npy_payload(np.arange(16, dtype=np.int32).reshape(4, 2, 2))
    triplet = Triplet(prompt_token_ids=[1, 2, 3], response_token_ids=[4, 5], routed_experts=routes)
    adapter = RolloutAdapter(max_prompt_length=4, max_response_length=4, pad_token_id=0)
    proto, _ = adapter.get_train_data_batch([succeeded_rollout([triplet])])
    assert isinstance(proto, DataProto)
    proto.check_consistency()
    tensor = proto.batch["routed_experts"]
    assert (tensor.dtype, tuple(tensor.shape)) == (torch.uint8, (1, 8, 2, 2))
    assert tensor[0, :, 0, 0].tolist() == [0, 0, 4, 8, 12, 0, 0, 0]


def test_data_proto_survives_verl_batch_operations() -> None:
    adapter = RolloutAdapter(max_prompt_length=4, max_response_length=6, pad_token_id=0)
    proto, _ = adapter.get_train_data_batch(_rollouts())
    assert isinstance(proto, DataProto)
    halves = proto.chunk(2)
    again = DataProto.concat(halves)
    assert torch.equal(again.batch["input_ids"], proto.batch["input_ids"])
    assert (
        again.non_tensor_batch["rollout_id_list"].tolist()
        == proto.non_tensor_batch["rollout_id_list"].tolist()
    )
    picked = proto.select_idxs(np.array([True, False, True, False, True, False])[: len(proto)])
    assert picked.non_tensor_batch["rollout_id_list"].tolist() == ["r0", "r2"]
    restored = pickle.loads(pickle.dumps(proto))
    assert torch.equal(restored.batch["responses"], proto.batch["responses"])


def test_response_mask_equals_verl_s_own_in_transition_mode() -> None:
    from verl.trainer.ppo.ray_trainer import compute_response_mask

    adapter = RolloutAdapter(
        max_prompt_length=4, max_response_length=6, pad_token_id=0, trace_aggregator_level="transition"
    )
    proto, _ = adapter.get_train_data_batch(_rollouts())
    assert isinstance(proto, DataProto)
    assert torch.equal(compute_response_mask(proto), proto.batch["response_mask"])
