"""The commands the READMEs and docs/ show, found where a reader copies them from.

Every ``agl-trainer``, ``agl-server``, ``agl-controller``, ``vllm serve`` and ``ray start`` command in a fenced
shell block (one command per line, ``\\`` continuations joined, ``#`` comments dropped, ``&&``, ``;``
and ``|`` separating commands) or in an inline code span (which may wrap over a line break) of the
root README, each package's README and ``docs/*.md``. An inline span that is only a program's name,
as in "`agl-server` records every call", is a mention, not a command. Leading ``NAME=value``
assignments are kept apart from the arguments, and an ``uv run`` before the program is dropped.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = ("agl-trainer", "agl-server", "agl-controller", "vllm serve", "ray start")
_SHELL_FENCE = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.DOTALL | re.MULTILINE)
_ANY_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
# A code span may wrap over a line break but not over a blank line (the paragraph's end).
_INLINE_CODE = re.compile(r"`([^`\n]+(?:\n[^`\n]+)*)`")
# $( ... ) with single-quoted text inside, e.g. PYTHONPATH=$(uv run python -c '...; print(x)').
_SUBSTITUTION = re.compile(r"\$\((?:'[^']*'|[^()'])*\)")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_OPERATORS = frozenset({"&&", "||", ";", "|", "&"})


@dataclass(frozen=True)
class DocCommand:
    """One documented command: its file and line, program, leading assignments and arguments."""

    file: str
    line: int
    program: str
    env: tuple[tuple[str, str], ...]
    args: tuple[str, ...]
    text: str

    @property
    def where(self) -> str:
        """``file:line``, the test case's id and what a failure names."""
        return f"{self.file}:{self.line}"


def doc_files() -> list[Path]:
    """The root README, the packages' READMEs and docs/*.md."""
    return [ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md")), *sorted(ROOT.glob("docs/*.md"))]


def doc_commands(program: str) -> list[DocCommand]:
    """Every command of ``program`` (one of :data:`PROGRAMS`) in :func:`doc_files`, in reading order."""
    assert program in PROGRAMS, f"Unsupported program: {program!r}. Supported: {list(PROGRAMS)}"
    found = (markdown_commands(path.read_text(), path.relative_to(ROOT).as_posix()) for path in doc_files())
    return [command for commands in found for command in commands if command.program == program]


def markdown_commands(markdown: str, file: str) -> list[DocCommand]:
    """The :data:`PROGRAMS` commands of one Markdown text, by line; ``file`` is what they name."""
    found = [
        command
        for line, text, inline in _snippets(markdown)
        for command in _commands_in(_words(text, f"{file}:{line}", inline), file, line)
        if not (inline and command.text == command.program)  # a mention of the name
    ]
    return sorted(found, key=lambda command: command.line)


def _snippets(markdown: str) -> Iterator[tuple[int, str, bool]]:
    """``(line, text, inline)`` of each shell line (continuations joined) and each inline code span."""
    for block in _SHELL_FENCE.finditer(markdown):
        first = markdown.count("\n", 0, block.start(1)) + 1
        yield from _shell_lines(block.group(1), first)
    # Fences are blanked, newlines kept, so spans are searched outside them with true line numbers.
    outside = _ANY_FENCE.sub(lambda fence: "\n" * fence.group().count("\n"), markdown)
    for span in _INLINE_CODE.finditer(outside):
        yield outside.count("\n", 0, span.start()) + 1, span.group(1).replace("\n", " "), True


def _shell_lines(block: str, first: int) -> Iterator[tuple[int, str, bool]]:
    start, pending = first, ""
    for number, line in enumerate(block.splitlines(), start=first):
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        yield start, pending + line, False
        pending = ""


def _words(text: str, where: str, inline: bool) -> list[str]:
    """The shell words of a snippet; none for an inline span that is no shell (an unmatched quote)."""
    lexer = shlex.shlex(_SUBSTITUTION.sub("$SUBSTITUTION", text), posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    try:
        return list(lexer)
    except ValueError as error:
        if inline:
            return []
        raise ValueError(f"{where}: {text!r} is not a shell line: {error}") from error


def _commands_in(words: list[str], file: str, line: int) -> Iterator[DocCommand]:
    simple: list[str] = []
    for word in [*words, ";"]:
        if word not in _OPERATORS:
            simple.append(word)
            continue
        if (command := _command(simple, file, line)) is not None:
            yield command
        simple = []


def _command(words: list[str], file: str, line: int) -> DocCommand | None:
    """The :data:`PROGRAMS` command ``words`` are, after assignments and ``uv run``; None for another."""
    leading = next((i for i, word in enumerate(words) if not _ASSIGNMENT.match(word)), len(words))
    env = tuple((key, value) for key, _, value in (word.partition("=") for word in words[:leading]))
    rest = words[leading:]
    if rest[:2] == ["uv", "run"]:
        rest = rest[2:]
    for program in PROGRAMS:
        name = program.split()
        if rest[: len(name)] == name:
            return DocCommand(file, line, program, env, tuple(rest[len(name) :]), " ".join(words))
    return None


__all__ = ("PROGRAMS", "ROOT", "DocCommand", "doc_commands", "doc_files", "markdown_commands")
