"""An actor for the weight-push tests: it saves one model folder's weights and scores the probe
with another's (by default the same), so a push can be driven without verl's workers."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from functools import cache
from pathlib import Path


class SavingActor:
    """Saves ``saves``' weights and answers the probe as ``holds`` (default ``saves``); an actor whose
    saved weights are not the ones it holds is a fault the real one cannot be made to show."""

    def __init__(self, saves: Path, holds: Path | None = None) -> None:
        self.saves = saves
        self.holds = holds or saves

    def save_hf_weights(self, path: Path) -> Path:
        return Path(shutil.copytree(self.saves, path))

    def probe_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        return list(prompt_logprobs(self.holds, tuple(token_ids)))


@cache
def prompt_logprobs(model_path: Path, token_ids: tuple[int, ...]) -> tuple[float, ...]:
    """Each of ``token_ids[1:]``'s log-prob given its prefix under the model at ``model_path`` (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logprobs = model(ids).logits.log_softmax(-1)[0, :-1]
    return tuple(logprobs.gather(-1, ids[0, 1:, None])[:, 0].tolist())


__all__ = ("SavingActor", "prompt_logprobs")
