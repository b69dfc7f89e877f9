"""One line for a check of verl's own that failed inside a Ray worker.

verl checks much of its configuration only where it uses it: in the workers, as they build the
actor or take a batch (batch-size divisibility, micro-batch sizes, dynamic batching). Such a check
reaches the driver as Ray's wrapper of the worker's traceback, many screens long. What it says is
in that traceback's last frame: the ``AssertionError`` or ``ValueError`` raised in verl's code, or,
for a bare ``assert``, its source line. :func:`verl_check_line` makes that one line, naming the
config keys the check reads, as agl's own checks do.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in [^\n]*\n(?P<source>[^\n]*)', re.M)
_RAISED = re.compile(r"^(?:AssertionError|ValueError)(?::\s*(?P<message>.*))?\Z", re.S)
_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


def verl_check_line(error: BaseException, keys: Sequence[str] = ()) -> str | None:
    """``agl-trainer: verl refused the configuration in a Ray worker (<verl file>:<line>): <what it
    says>; keys: <those of ``keys``, the run's config keys, that it names>``, when ``error`` (or an
    error it was raised from) is an ``AssertionError`` or ``ValueError`` raised by verl's code in a
    Ray worker; else None."""
    for seen in _chain(error):
        text = _worker_traceback(seen)
        if text is not None:
            return _line(text, keys)
    return None


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: BaseException | None = error
    visited: set[int] = set()
    while seen is not None and id(seen) not in visited:
        visited.add(id(seen))
        yield seen
        seen = seen.__cause__ or seen.__context__


def _worker_traceback(error: BaseException) -> str | None:
    """The worker's traceback text of a task that raised, or of an actor whose creation raised."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(error, RayTaskError) or (isinstance(error, RayActorError) and error.actor_init_failed):
        return str(error)  # the traceback, also of the copy raised as the cause's class too
    return None


def _line(text: str, config_keys: Sequence[str]) -> str | None:
    """The line for the last check raised in verl's code that ``text`` (a traceback, chained
    exceptions included: hydra wraps a check failed while a config dataclass is built) shows."""
    frames = list(_FRAME.finditer(text))
    checks = [
        (frame, raised)
        for frame, end in zip(frames, [f.start() for f in frames[1:]] + [len(text)], strict=True)
        if "/verl/" in frame["path"] and (raised := _RAISED.match(_exception(text[frame.end() : end])))
    ]
    if not checks:
        return None
    frame, raised = checks[-1]
    said = " ".join((raised["message"] or "").split()) or frame["source"].strip()
    path = frame["path"]
    where = f"{path[path.rindex('/verl/') + 1 :]}:{frame['line']}"
    keys = _keys(f"{raised['message'] or ''} {frame['source']}", config_keys)
    named = f"; keys: {', '.join(keys)}" if keys else ""
    return f"agl-trainer: verl refused the configuration in a Ray worker ({where}): {said}{named}"


def _exception(after_frame: str) -> str:
    """The exception a frame raised: the lines after its source (``^^^`` markers dropped) up to the
    blank line that ends it."""
    lines: list[str] = []
    for line in after_frame.strip("\n").splitlines():
        if not line.strip():
            break
        if line.strip().strip("^~ "):
            lines.append(line)
    return "\n".join(lines).strip()


def _keys(text: str, config_keys: Sequence[str]) -> list[str]:
    """The ``config_keys`` that ``text`` names, each name matched against the end of every key: a
    dotted name (``self.config.`` dropped) all it matches, a snake_case one only the one key it
    matches (``use_dynamic_bsz`` alone could be any section's)."""
    found: list[str] = []
    for name in _NAME.findall(text):
        name = re.sub(r"^(?:self\.)?(?:config\.)?", "", name)
        if "_" not in name and "." not in name:
            continue
        matches = [key for key in config_keys if key == name or key.endswith(f".{name}")]
        if "." in name or len(matches) == 1:
            found += [key for key in matches if key not in found]
    return found


__all__ = ("verl_check_line",)
