"""The toy tasks' heavy-tailed tool latency: lognormal with the given median and 99th percentile, seeded."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from agl_trainer.local import AgentContext, Completion, DigitToolTask, ToolLatency


def test_draws_have_the_given_median_and_99th_percentile() -> None:
    latency = ToolLatency.parse("0.5:6", seed=1)
    draws = sorted(latency.sample() for _ in range(20_000))
    assert statistics.median(draws) == pytest.approx(0.5, rel=0.05)
    assert draws[int(0.99 * len(draws))] == pytest.approx(6.0, rel=0.15)


def test_the_same_seed_gives_the_same_draws() -> None:
    first, second = ToolLatency(0.5, 6.0, seed=7), ToolLatency(0.5, 6.0, seed=7)
    assert [first.sample() for _ in range(5)] == [second.sample() for _ in range(5)]


@pytest.mark.parametrize("text", ["0.5", "fast:6", "2:1", "0:1"])
def test_a_malformed_latency_is_refused_naming_the_shortcut(text: str) -> None:
    with pytest.raises(ValueError, match=r"tool_latency="):
        ToolLatency.parse(text)


class _OneTokenModel:
    """Answers every call with token 0."""

    def complete(self, prompt_ids: Sequence[int], max_tokens: int, **_params: Any) -> Completion:
        return Completion(
            prompt_ids=list(prompt_ids), token_ids=[0], logprobs=None, text="0", finish_reason="length"
        )


def test_each_tool_call_of_the_toy_agent_waits_one_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    import agl_trainer.local.toy_task as toy_task

    slept: list[float] = []
    monkeypatch.setattr(toy_task.time, "sleep", slept.append)
    tokenizer = Tokenizer(WordLevel({"0": 0, "[UNK]": 1}, unk_token="[UNK]"))
    task = DigitToolTask(tokenizer, frozenset({0}), turns=3, tool_latency=ToolLatency(0.5, 6.0, seed=3))
    context = AgentContext(rollout_id="r", input={"prompt": "0"}, is_train=True, model=_OneTokenModel())
    task(context)
    same_seed = ToolLatency(0.5, 6.0, seed=3)
    assert slept == [same_seed.sample(), same_seed.sample()]  # 3 model turns, 2 tool calls between them
