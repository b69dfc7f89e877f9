"""R3 routing replay on the trainer side: the adapter's MoE routes reach verl's engine input intact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl import DataProto

from agl_adapter import RolloutAdapter
from agl_testing.routes import npy_payload, succeeded_rollout
from agl_trainer.verl_glue.workers import no_padding_batch
from agl_types import CompletedRollout, Triplet

pytestmark = pytest.mark.verl


def _rollout(sample: int, prompt: list[int], response: list[int]) -> CompletedRollout:
    n_routed = len(prompt) + len(response) - 1
    routes = np.arange(n_routed * 4, dtype=np.int32).reshape(n_routed, 2, 2) + 10 * sample
    triplet = Triplet(
        prompt_token_ids=prompt, response_token_ids=response, routed_experts=npy_payload(routes)
    )
    return succeeded_rollout([triplet], rollout_id=f"r{sample}", sample=sample)


def test_routes_follow_input_ids_into_verls_no_padding_layout() -> None:
    adapter = RolloutAdapter(
        max_prompt_length=4, max_response_length=3, pad_token_id=0, require_routed_experts=True
    )
    rollouts = [_rollout(0, [5, 6], [7, 8, 9]), _rollout(1, [1, 2, 3, 4], [9])]
    proto, _ = adapter.get_train_data_batch(rollouts)
    assert isinstance(proto, DataProto)
    padded = proto.batch["routed_experts"]
    td = no_padding_batch(proto, temperature=1.0)
    routes, ids = td["routed_experts"], td["input_ids"]
    for row, mask in enumerate(proto.batch["attention_mask"].bool()):
        assert torch.equal(routes[row], padded[row][mask])
        assert len(routes[row]) == len(ids[row])
    assert routes[0][:, 0, 0].tolist() == [0, 4, 8, 12, 0]  # the last generated token has no route
    assert routes[1][:, 0, 0].tolist() == [10, 14, 18, 22, 0]


def _tiny_moe() -> torch.nn.Module:
    """A 2-layer Qwen2-MoE (4 experts, top-2) built from a config, no download."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(config).eval()


@torch.no_grad()
def _top_experts(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """(tokens, layers, top_k): the experts each token is routed to, sorted per layer."""
    logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
    top = torch.stack([layer.topk(2, dim=-1).indices for layer in logits], dim=1)
    return top.sort(dim=-1).values


def test_a_tiny_moes_recorded_routes_land_under_the_tokens_that_were_routed() -> None:
    """The engine's routes of a two-call agent, through the adapter, equal the router's choice when the
    training forward sees the row's tokens: what R3 replay relies on."""
    model = _tiny_moe()
    first_prompt, first_response = [3, 9, 4], [17, 5]
    second_prompt = [*first_prompt, *first_response, 40, 41]
    second_response = [22, 23, 24]
    context = [*second_prompt, *second_response]
    engine_routes = (
        _top_experts(model, context)[:-1].numpy().astype(np.int64)
    )  # the last token is never fed back
    triplets = [
        Triplet(prompt_token_ids=first_prompt, response_token_ids=first_response),
        Triplet(
            prompt_token_ids=second_prompt,
            response_token_ids=second_response,
            routed_experts=npy_payload(engine_routes),
        ),
    ]
    rollout = succeeded_rollout(triplets)
    for level in ("trajectory", "transition"):
        adapter = RolloutAdapter(
            max_prompt_length=8,
            max_response_length=8,
            pad_token_id=0,
            trace_aggregator_level=level,
            require_routed_experts=True,
        )
        batch, _ = adapter.build_batch([rollout])
        assert batch.routed_experts is not None
        for row, mask in enumerate(batch.attention_mask.bool()):
            ids = batch.input_ids[row][mask].tolist()
            replayed = batch.routed_experts[row][mask].long()
            training = _top_experts(model, ids)
            covered = len(ids) - 1 if ids == context else len(ids)
            assert torch.equal(replayed[:covered].sort(dim=-1).values, training[:covered]), level
            assert not replayed[covered:].any()
