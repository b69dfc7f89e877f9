"""The built-in tasks of ``agl-trainer task=NAME``: write one kind of token, with a counting tool.

Each rollout is two model turns with a tool call between them. Turn 1 continues the sample's
prompt; the tool then counts the target tokens written so far and its answer
(``"\\n[tool] 3 digits\\n"``) is appended as an observation; turn 2 continues prompt + turn 1 +
observation, so the gateway records two ``model_request`` events whose second prompt starts with
the first prompt and response. The reward is the share of generated tokens that are target
tokens: dense, in [0, 1], about ``n_target_tokens / vocab_size`` for a random policy, and
learnable by a tiny model in tens of GRPO steps because every target token raises it.

The tasks differ only in their :class:`TokenKind`: ``digits`` (:class:`DigitToolTask`, tokens of
ASCII digits, the default) and ``upper`` (:class:`UpperToolTask`, tokens of ASCII capitals).
"""

from __future__ import annotations

import math
import random
import string
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Self

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
UPPER_PROMPTS = (
    "Shout it:",
    "WRITE IN CAPITALS:",
    "Caps lock is on:",
    "Acronyms:",
    "Say it LOUD:",
    "Upper case only please:",
    "Initials:",
    "Capital letters:",
)


def _only_chars(text: str, chars: str) -> bool:
    body = text[1:] if text.startswith(" ") else text
    return bool(body) and all(char in chars for char in body)


def is_digit_text(text: str) -> bool:
    """Whether a token's text is ASCII digits only (one leading space allowed)."""
    return _only_chars(text, string.digits)


def is_upper_text(text: str) -> bool:
    """Whether a token's text is uppercase ASCII letters only (one leading space allowed)."""
    return _only_chars(text, string.ascii_uppercase)


@dataclass(frozen=True)
class TokenKind:
    """What a task rewards: tokens whose text ``matches``, counted by the tool as ``label``."""

    label: str
    matches: Callable[[str], bool]
    prompts: tuple[str, ...]


DIGITS = TokenKind(label="digits", matches=is_digit_text, prompts=PROMPTS)
CAPITALS = TokenKind(label="capitals", matches=is_upper_text, prompts=UPPER_PROMPTS)


_Z_99 = 2.3263478740408408
"""The standard normal's 99th percentile: a lognormal's p99 is ``exp(mu + _Z_99 * sigma)``."""


@dataclass(frozen=True)
class ToolLatency:
    """How long each tool call takes: lognormal with ``median`` and 99th percentile ``p99`` seconds.

    Heavy-tailed like real agents' tools (a search, a test run). Draws come from one generator
    seeded with ``seed``, shared by every agent thread.
    """

    median: float
    p99: float
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False, compare=False)
    _lock: threading.Lock = field(init=False, repr=False, compare=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if not (self.median > 0 and math.isfinite(self.p99) and self.p99 >= self.median):
            raise ValueError(
                f"tool_latency needs 0 < MEDIAN <= P99 (seconds), got median={self.median}, p99={self.p99}"
            )
        object.__setattr__(self, "_rng", random.Random(self.seed))

    @classmethod
    def parse(cls, text: str, seed: int = 0) -> ToolLatency:
        """``"MEDIAN:P99"`` in seconds, e.g. ``"0.5:6"``."""
        median, _, p99 = text.partition(":")
        try:
            return cls(float(median), float(p99), seed)
        except ValueError as exc:
            raise ValueError(
                f"tool_latency={text!r}: expected MEDIAN:P99 in seconds, e.g. 0.5:6 ({exc})"
            ) from exc

    @property
    def sigma(self) -> float:
        return math.log(self.p99 / self.median) / _Z_99

    def sample(self) -> float:
        """One tool call's latency in seconds."""
        with self._lock:
            return self._rng.lognormvariate(math.log(self.median), self.sigma)


@dataclass(frozen=True)
class TokenShareTask:
    """A task and its agent (instances are callable as an ``Agent``); subclasses set ``kind``.

    ``target_ids`` are the tokenizer's tokens of that kind. ``max_tokens_per_turn`` bounds each of
    the ``turns`` model calls; rewards are shares of the ``turns * max_tokens_per_turn`` (at most)
    generated tokens. ``tool_latency`` makes each tool call wait (none by default).
    """

    kind: ClassVar[TokenKind]
    tokenizer: Tokenizer
    target_ids: frozenset[int]
    turns: int = 2
    max_tokens_per_turn: int = 8
    tool_latency: ToolLatency | None = None

    @classmethod
    def from_model(cls, model_path: Path, turns: int = 2, max_tokens_per_turn: int = 8) -> Self:
        """Build the task for the tokenizer in ``model_path/tokenizer.json``."""
        tokenizer_file = model_path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} is missing; the toy task needs a fast (tokenizers) tokenizer saved with the model"
            )
        if turns < 1 or max_tokens_per_turn < 1:
            raise ValueError(f"turns={turns} and max_tokens_per_turn={max_tokens_per_turn} must both be >= 1")
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        target_ids = frozenset(
            token_id
            for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True))
            if cls.kind.matches(tokenizer.decode([token_id], skip_special_tokens=False))
        )
        if not target_ids:
            raise ValueError(
                f"the tokenizer in {model_path} has no {cls.kind.label} tokens; the toy task cannot reward "
                "anything: pick another task= or a model whose vocabulary has them"
            )
        return cls(
            tokenizer=tokenizer, target_ids=target_ids, turns=turns, max_tokens_per_turn=max_tokens_per_turn
        )

    def samples(self, n: int) -> list[dict[str, Any]]:
        """``n`` rollout inputs, cycling through the kind's prompts."""
        prompts = self.kind.prompts
        return [{"prompt": prompts[index % len(prompts)], "index": index} for index in range(n)]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def observation(self, generated: Sequence[int]) -> str:
        """The counting tool's answer after the tokens generated so far."""
        count = sum(token in self.target_ids for token in generated)
        return f"\n[tool] {count} {self.kind.label}\n"

    def reward(self, generated: Sequence[int]) -> float:
        """Share of ``generated`` that are target tokens; 0.0 for an empty generation."""
        if not generated:
            return 0.0
        return sum(token in self.target_ids for token in generated) / len(generated)

    def __call__(self, context: AgentContext) -> float:
        """Run one rollout: model, tool, model, ... and return the reward."""
        prompt = self.encode(str(context.input["prompt"]))
        generated: list[int] = []
        for turn in range(self.turns):
            completion = context.model.complete(prompt, max_tokens=self.max_tokens_per_turn)
            generated += completion.token_ids
            prompt = prompt + completion.token_ids
            if turn < self.turns - 1:
                if self.tool_latency is not None:
                    time.sleep(self.tool_latency.sample())
                prompt = prompt + self.encode(self.observation(generated))
        return self.reward(generated)


class DigitToolTask(TokenShareTask):
    """Write digits (``task=digits``): reward = share of digit tokens, the tool counts "digits"."""

    kind = DIGITS


class UpperToolTask(TokenShareTask):
    """Write capitals (``task=upper``): reward = share of capital-letter tokens, the tool counts "capitals"."""

    kind = CAPITALS


TOY_TASKS: dict[str, Callable[[Path], TokenShareTask]] = {
    "digits": DigitToolTask.from_model,
    "upper": UpperToolTask.from_model,
}
"""The embedded default's tasks by the name ``agl-trainer task=NAME`` takes; each builds from the model folder."""
