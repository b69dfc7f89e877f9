"""The built-in toy tasks (digits, capitals) with a counting tool: token sets, tool text, reward,
the agent loop and the registry ``agl-trainer task=NAME`` picks from."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from agl_trainer.local import AgentContext, Completion, DigitToolTask, tiny_model
from agl_trainer.local.toy_task import (
    PROMPTS,
    TOY_TASKS,
    UPPER_PROMPTS,
    TokenShareTask,
    UpperToolTask,
    is_digit_text,
    is_upper_text,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model.build_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def task(model: Path) -> DigitToolTask:
    return DigitToolTask.from_model(model)


@pytest.fixture(scope="module")
def upper(model: Path) -> UpperToolTask:
    return UpperToolTask.from_model(model)


@pytest.mark.parametrize(
    ("predicate", "text", "expected"),
    [
        (is_digit_text, "7", True),
        (is_digit_text, " 42", True),
        (is_digit_text, "007", True),
        (is_digit_text, "4a", False),
        (is_digit_text, "٣", False),
        (is_upper_text, "A", True),
        (is_upper_text, " HI", True),
        (is_upper_text, "Ab", False),
        (is_upper_text, "A1", False),
        (is_upper_text, "É", False),
        *(
            (predicate, text, False)
            for predicate in (is_digit_text, is_upper_text)
            for text in ("", " ", "  A", "  4")
        ),
    ],
)
def test_token_text_is_only_the_kinds_characters_after_at_most_one_space(
    predicate: Callable[[str], bool], text: str, expected: bool
) -> None:
    assert predicate(text) is expected


def test_target_ids_of_the_digit_task_are_exactly_the_digit_tokens(task: DigitToolTask) -> None:
    # Independent of the task's predicate: a regular expression over the vocabulary's texts.
    digits = re.compile(r" ?[0-9]+")
    vocab = task.tokenizer.get_vocab_size(with_added_tokens=True)
    texts = {i: task.tokenizer.decode([i], skip_special_tokens=False) for i in range(vocab)}
    assert task.target_ids == {i for i, text in texts.items() if digits.fullmatch(text)}
    assert {task.encode(str(d))[0] for d in range(10)} <= task.target_ids
    assert not {task.encode(text)[0] for text in ("a", "A", " ", ".")} & task.target_ids


def test_tiny_model_has_as_many_capital_tokens_as_digit_tokens(
    task: DigitToolTask, upper: UpperToolTask
) -> None:
    # A random policy's reward is about targets / vocab, so both tasks start from the same ~5.6 %.
    assert task.tokenizer.get_vocab_size(with_added_tokens=True) == 492
    assert (len(task.target_ids), len(upper.target_ids)) == (27, 28)
    capitals = {upper.tokenizer.decode([i]) for i in upper.target_ids}
    assert capitals == {*"ABCDEFGHIJKLMNOPQRSTUVWXYZ", " H", " I"}


def test_reward_is_share_of_digit_tokens(task: DigitToolTask) -> None:
    [digit], [other] = task.encode("7"), task.encode("x")
    assert task.reward([digit, other, other, other]) == 0.25
    assert task.reward([digit, digit]) == 1.0
    assert task.reward([]) == 0.0


def test_reward_is_share_of_capital_tokens(upper: UpperToolTask) -> None:
    [capital], [space_capital], [lower], [digit] = (upper.encode(t) for t in ("Q", " H", "x", "7"))
    assert upper.reward([capital, lower, digit, space_capital]) == 0.5
    assert upper.reward([lower, digit]) == 0.0


def test_observation_counts_digit_tokens(task: DigitToolTask) -> None:
    [digit], [other] = task.encode("7"), task.encode("x")
    assert task.observation([digit, other, digit]) == "\n[tool] 2 digits\n"


def test_observation_counts_capital_tokens(upper: UpperToolTask) -> None:
    [capital], [lower] = upper.encode("Q"), upper.encode("x")
    assert upper.observation([capital, lower, capital, capital]) == "\n[tool] 3 capitals\n"


@pytest.mark.parametrize(("name", "prompts"), [("digits", PROMPTS), ("upper", UPPER_PROMPTS)])
def test_samples_cycle_through_the_tasks_prompts(model: Path, name: str, prompts: tuple[str, ...]) -> None:
    samples = TOY_TASKS[name](model).samples(len(prompts) + 1)
    assert samples[0] == {"prompt": prompts[0], "index": 0}
    assert samples[-1] == {"prompt": prompts[0], "index": len(prompts)}


def test_registry_builds_each_named_task(model: Path) -> None:
    built = {name: type(build(model)) for name, build in TOY_TASKS.items()}
    assert built == {"digits": DigitToolTask, "upper": UpperToolTask}


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
    [digit], [other] = task.encode("7"), task.encode("x")
    model = _ScriptedModel([[digit, other], [digit, digit]])
    context = AgentContext(rollout_id="r", input={"prompt": "Numbers:"}, is_train=True, model=model)
    reward = DigitToolTask(task.tokenizer, task.target_ids, turns=2, max_tokens_per_turn=2)(context)
    first = task.encode("Numbers:")
    assert model.prompts == [first, [*first, digit, other, *task.encode("\n[tool] 1 digits\n")]]
    assert reward == 0.75


def test_from_model_without_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json is missing"):
        DigitToolTask.from_model(tmp_path)


@pytest.mark.parametrize(("task_class", "label"), [(DigitToolTask, "digits"), (UpperToolTask, "capitals")])
def test_from_model_with_no_target_tokens_names_the_kind(
    tmp_path: Path, task_class: type[TokenShareTask], label: str
) -> None:
    letters_only = Tokenizer(WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    letters_only.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=f"has no {label} tokens; the toy task cannot reward anything"):
        task_class.from_model(tmp_path)
