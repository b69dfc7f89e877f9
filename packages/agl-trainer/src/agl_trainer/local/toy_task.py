"""The built-in task of ``agl-trainer`` with no arguments: write digits, with a counting tool.

Each rollout is two model turns with a tool call between them. Turn 1 continues the sample's
prompt; the tool then counts the digits written so far and its answer (``"\\n[tool] 3 digits\\n"``)
is appended as an observation; turn 2 continues prompt + turn 1 + observation, so the gateway
records two ``model_request`` events whose second prompt starts with the first prompt and
response. The reward is the share of generated tokens that are digit tokens (tokens whose text
is only ASCII digits, optionally after a space): dense, in [0, 1], about
``n_digit_tokens / vocab_size`` for a random policy, and learnable by a tiny model in tens of
GRPO steps because every digit token raises it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from agl_trainer.local.agent import AgentContext

PROMPTS = (
    "Write numbers:",
    "Count with me:",
    "The answer is",
    "Digits only please:",
    "Phone number:",
    "Give me a number.",
    "Numbers:",
    "Say some digits:",
)
_DIGITS = frozenset("0123456789")


def is_digit_text(text: str) -> bool:
    """Whether a token's text is digits only (one leading space allowed)."""
    body = text[1:] if text.startswith(" ") else text
    return bool(body) and all(char in _DIGITS for char in body)


@dataclass(frozen=True)
class DigitToolTask:
    """The task and its agent (instances are callable as an ``Agent``).

    ``max_tokens_per_turn`` bounds each of the ``turns`` model calls; rewards are shares of the
    ``turns * max_tokens_per_turn`` (at most) generated tokens.
    """

    tokenizer: Tokenizer
    digit_ids: frozenset[int]
    turns: int = 2
    max_tokens_per_turn: int = 8

    @classmethod
    def from_model(cls, model_path: Path, turns: int = 2, max_tokens_per_turn: int = 8) -> DigitToolTask:
        """Build the task for the tokenizer in ``model_path/tokenizer.json``."""
        tokenizer_file = model_path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} is missing; the toy task needs a fast (tokenizers) tokenizer saved with the model"
            )
        if turns < 1 or max_tokens_per_turn < 1:
            raise ValueError(f"turns={turns} and max_tokens_per_turn={max_tokens_per_turn} must both be >= 1")
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        digit_ids = frozenset(
            token_id
            for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True))
            if is_digit_text(tokenizer.decode([token_id], skip_special_tokens=False))
        )
        if not digit_ids:
            raise ValueError(
                f"the tokenizer in {model_path} has no digit tokens; the toy task cannot reward anything"
            )
        return cls(
            tokenizer=tokenizer, digit_ids=digit_ids, turns=turns, max_tokens_per_turn=max_tokens_per_turn
        )

    def samples(self, n: int) -> list[dict[str, Any]]:
        """``n`` rollout inputs, cycling through the built-in prompts."""
        return [{"prompt": PROMPTS[index % len(PROMPTS)], "index": index} for index in range(n)]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def observation(self, generated: Sequence[int]) -> str:
        """The counting tool's answer after the tokens generated so far."""
        count = sum(token in self.digit_ids for token in generated)
        return f"\n[tool] {count} digits\n"

    def reward(self, generated: Sequence[int]) -> float:
        """Share of ``generated`` that are digit tokens; 0.0 for an empty generation."""
        if not generated:
            return 0.0
        return sum(token in self.digit_ids for token in generated) / len(generated)

    def __call__(self, context: AgentContext) -> float:
        """Run one rollout: model, tool, model, ... and return the reward."""
        prompt = self.encode(str(context.input["prompt"]))
        generated: list[int] = []
        for turn in range(self.turns):
            completion = context.model.complete(prompt, max_tokens=self.max_tokens_per_turn)
            generated += completion.token_ids
            prompt = prompt + completion.token_ids
            if turn < self.turns - 1:
                prompt = prompt + self.encode(self.observation(generated))
        return self.reward(generated)


TOY_TASKS: dict[str, Callable[[Path], DigitToolTask]] = {"digits": DigitToolTask.from_model}
"""The embedded default's tasks by the name ``agl-trainer task=NAME`` takes; each builds from the model folder."""
