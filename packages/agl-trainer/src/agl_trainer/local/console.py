"""The embedded default's console: one compact line per step, read from verl's ``file`` logger.

verl's ``console`` logger prints every metric of a step (about 150) on one line. The embedded
default leaves it out of ``trainer.logger`` and instead follows ``metrics.jsonl`` from a thread,
printing for each record the step, reward, validation reward, step time split into waiting,
training and pushing, staleness (fully-async) and rollouts failed. The trainer is not touched:
whatever verl logs, to whichever loggers, stays as it is.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, TextIO

from agl_trainer.terminal import terminal


def _number(data: Mapping[str, Any], key: str) -> float | None:
    value = data.get(key)
    return float(value) if isinstance(value, int | float) else None


def step_time_split(data: Mapping[str, Any]) -> tuple[float, float, float] | None:
    """``(waiting, training, pushing)`` seconds of the step, or None for a record without a step.

    Waiting is collection (verl's ``gen`` timer: until enough groups finished), pushing is the
    weight publish (``update_weights``), training is the rest of the step; validation and
    checkpoints are timed outside the step.
    """
    step = _number(data, "timing_s/step")
    if step is None:
        return None
    wait = _number(data, "timing_s/gen") or 0.0
    push = _number(data, "timing_s/update_weights") or 0.0
    return wait, max(0.0, step - wait - push), push


def _time_part(data: Mapping[str, Any]) -> str | None:
    split = step_time_split(data)
    if split is None:
        return None
    wait, train, push = split
    return f"time {sum(split):.1f} s = wait {wait:.1f} + train {train:.1f} + push {push:.1f}"


def _rollouts_part(data: Mapping[str, Any]) -> str | None:
    """``rollouts 14 ok, 2 failed``: the rollouts that finished since the last step (failed counts
    the timed-out too); in fully-async mode not the ones the step trained, which may have finished earlier."""
    counts = [
        _number(data, f"training/n_rollouts_{outcome}") for outcome in ("succeeded", "failed", "timed_out")
    ]
    if any(count is None for count in counts):
        return None
    succeeded, failed, timed_out = (int(count or 0) for count in counts)
    return f"rollouts {succeeded} ok, {failed + timed_out} failed"


def step_line(step: int, data: Mapping[str, Any], *, total_steps: int, fully_async: bool) -> str:
    """One step's metrics (a record of verl's file logger) as one line; a part whose metrics the
    record lacks (e.g. a validation before training has no reward or time) is left out."""
    parts = [f"step {step:>{len(str(total_steps))}}/{total_steps}"]
    if (reward := _number(data, "training/reward")) is not None:
        parts.append(f"reward {reward:.3f}")
    if (val := _number(data, "val/reward")) is not None:
        testing = _number(data, "timing_s/testing")
        parts.append(f"val {val:.3f}" + (f" ({testing:.1f} s)" if testing is not None else ""))
    if (timing := _time_part(data)) is not None:
        parts.append(timing)
    staleness = _number(data, "training/async/staleness_max")
    if fully_async and staleness is not None:
        mean = _number(data, "training/async/staleness_mean") or 0.0
        parts.append(f"staleness max {staleness:.0f} mean {mean:.1f}")
    if (rollouts := _rollouts_part(data)) is not None:
        parts.append(rollouts)
    return "  ".join(parts)


class MetricsFollower:
    """Calls ``on_record(step, data)`` for each complete record appended to ``jsonl``.

    Reads from where it stopped at each :meth:`poll`; a partly written last line waits for the
    next poll, and a file that shrank (verl's logger truncates it when it opens) is read from the start.
    """

    def __init__(self, jsonl: Path, on_record: Callable[[int, Mapping[str, Any]], None]) -> None:
        self.jsonl = jsonl
        self.on_record = on_record
        self._offset = 0

    def poll(self) -> None:
        """Hand every complete record appended since the last poll to ``on_record``."""
        try:
            with self.jsonl.open("rb") as file:
                if file.seek(0, 2) < self._offset:
                    self._offset = 0
                file.seek(self._offset)
                chunk = file.read()
        except FileNotFoundError:
            return
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.splitlines():
            if line.strip():
                record = json.loads(line)
                self.on_record(int(record["step"]), record["data"])


@contextmanager
def follow_metrics(
    jsonl: Path, on_record: Callable[[int, Mapping[str, Any]], None], *, poll_seconds: float = 0.2
) -> Generator[MetricsFollower]:
    """Poll ``jsonl`` from a daemon thread while the block runs, and once more after it."""
    follower = MetricsFollower(jsonl, on_record)
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(poll_seconds):
            follower.poll()

    thread = threading.Thread(target=loop, name="agl-console", daemon=True)
    thread.start()
    try:
        yield follower
    finally:
        stop.set()
        thread.join()
        follower.poll()


def write_above_progress_bar(line: str, file: TextIO | None = None) -> None:
    """Write ``line`` to ``file`` (agl's stdout, :func:`agl_trainer.terminal.terminal`) above the
    trainer's "Training Progress" bar: tqdm clears the bar, writes, and draws it again (a plain
    write would run on from the bar)."""
    from tqdm import tqdm

    tqdm.write(line, file=file or terminal().out)


def compact_console(
    jsonl: Path,
    *,
    loggers: Sequence[str],
    total_steps: int,
    fully_async: bool,
    write: Callable[[str], None] = write_above_progress_bar,
) -> AbstractContextManager[object]:
    """While the block runs, write one :func:`step_line` per record of ``jsonl``, unless ``loggers``
    (``trainer.logger``) has verl's ``console``, which prints every metric itself."""
    if "console" in loggers:
        return nullcontext()

    def on_record(step: int, data: Mapping[str, Any]) -> None:
        write(step_line(step, data, total_steps=total_steps, fully_async=fully_async))

    return follow_metrics(jsonl, on_record)


__all__ = (
    "MetricsFollower",
    "compact_console",
    "follow_metrics",
    "step_line",
    "step_time_split",
    "write_above_progress_bar",
)
