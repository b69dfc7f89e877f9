"""The probe as a verl batch: the rows the actor scores to say which weights it holds.

A server's weights are told from the actor's by one short token sequence: each token's log-prob
given its prefix, as vLLM answers ``prompt_logprobs`` and as the actor computes it here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from verl import DataProto


def probe_batch(token_ids: Sequence[int], rows: int) -> DataProto:
    """``rows`` copies of ``token_ids`` as a one-token prompt and the rest as its response, with
    no padding, at temperature 1 (the log-probs vLLM reports for a prompt are of the raw logits)."""
    if len(token_ids) < 2:
        raise ValueError(f"token_ids has {len(token_ids)} tokens; a probe needs at least 2")
    ids = torch.tensor([list(token_ids)] * rows, dtype=torch.long)
    ones = torch.ones_like(ids)
    batch = DataProto.from_dict(
        {
            "prompts": ids[:, :1],
            "responses": ids[:, 1:],
            "input_ids": ids,
            "attention_mask": ones,
            "position_ids": ones.cumsum(dim=1) - 1,
            "response_mask": ones[:, 1:],
        }
    )
    batch.meta_info["temperature"] = 1.0
    return batch


__all__ = ("probe_batch",)
