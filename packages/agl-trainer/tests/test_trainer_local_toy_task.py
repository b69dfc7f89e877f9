"""The built-in digits-with-a-counting-tool task: token sets, tool text, reward and the agent loop."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from agl_trainer.local import AgentContext, Completion, DigitToolTask
from agl_trainer.local.toy_task import PROMPTS, is_digit_text

tiny_model = pytest.importorskip("agl_trainer.tiny_model")


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> DigitToolTask:
    return DigitToolTask.from_model(tiny_model.build_tiny_model(tmp_path_factory.mktemp("tiny") / "m"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("7", True),
        (" 42", True),
        ("007", True),
        ("", False),
        (" ", False),
        ("4a", False),
        ("  4", False),
        ("٣", False),
    ],
)
def test_is_digit_text(text: str, expected: bool) -> None:
    assert is_digit_text(text) is expected


def test_digit_ids_are_exactly_the_digit_tokens(task: DigitToolTask) -> None:
    vocab = task.tokenizer.get_vocab_size(with_added_tokens=True)
    expected = {
        i for i in range(vocab) if is_digit_text(task.tokenizer.decode([i], skip_special_tokens=False))
    }
    assert task.digit_ids == expected
    assert {task.encode(str(d))[0] for d in range(10)} <= task.digit_ids


def test_reward_is_share_of_digit_tokens(task: DigitToolTask) -> None:
    digit = min(task.digit_ids)
    other = next(i for i in range(100) if i not in task.digit_ids)
    assert task.reward([digit, other, other, other]) == 0.25
    assert task.reward([digit, digit]) == 1.0
    assert task.reward([]) == 0.0


def test_observation_counts_digit_tokens(task: DigitToolTask) -> None:
    digit = min(task.digit_ids)
    other = next(i for i in range(100) if i not in task.digit_ids)
    assert task.observation([digit, other, digit]) == "\n[tool] 2 digits\n"


def test_samples_cycle_through_prompts(task: DigitToolTask) -> None:
    samples = task.samples(len(PROMPTS) + 1)
    assert samples[0] == {"prompt": PROMPTS[0], "index": 0}
    assert samples[-1] == {"prompt": PROMPTS[0], "index": len(PROMPTS)}


class _ScriptedModel:
    """Answers each call with the next scripted token list and records the prompts."""

    def __init__(self, answers: list[list[int]]) -> None:
        self.answers = answers
        self.prompts: list[list[int]] = []

    def complete(self, prompt_ids: Sequence[int], max_tokens: int, **_params: Any) -> Completion:
        self.prompts.append(list(prompt_ids))
        tokens = self.answers[len(self.prompts) - 1][:max_tokens]
        return Completion(
            prompt_ids=list(prompt_ids), token_ids=tokens, logprobs=None, text="", finish_reason="length"
        )


def test_agent_extends_prompt_with_response_and_tool_observation(task: DigitToolTask) -> None:
    digit = min(task.digit_ids)
    other = next(i for i in range(100) if i not in task.digit_ids)
    model = _ScriptedModel([[digit, other], [digit, digit]])
    context = AgentContext(rollout_id="r", input={"prompt": "Numbers:"}, is_train=True, model=model)
    reward = DigitToolTask(task.tokenizer, task.digit_ids, turns=2, max_tokens_per_turn=2)(context)
    first = task.encode("Numbers:")
    assert model.prompts == [first, [*first, digit, other, *task.encode("\n[tool] 1 digits\n")]]
    assert reward == 0.75


def test_from_model_without_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json is missing"):
        DigitToolTask.from_model(tmp_path)
