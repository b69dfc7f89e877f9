"""Trace-merge mismatches: the entries recorded when a turn does not continue its row, and where they go.

An entry says which rollout and turn broke the prefix, with both token sequences decoded, so a
chat-template or re-tokenisation problem can be read off the text. Entries go to a
``MismatchSink``; by default wandb (a table under ``training/trace_merge_mismatches``) when a
wandb run is active, else the log.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, TypedDict

logger = logging.getLogger("agl_adapter")

MISMATCH_COLUMNS = (
    "global_steps",
    "rollout_id",
    "data_id",
    "turn_index",
    "template_mismatch",
    "retoken_mismatch",
    "others_mismatch",
    "prompt_length",
    "response_length",
    "previous_trace_length",
    "current_trace_length",
    "previous_trace",
    "current_trace",
)


class MismatchEntry(TypedDict):
    """One prefix break. Keys in ``MISMATCH_COLUMNS`` order (the wandb table's columns).

    ``turn_index`` is the turn that did not continue; ``previous_trace`` is the previous turn's
    prompt + response, ``current_trace`` this turn's, decoded (ids joined by spaces without a
    tokenizer) and cut to the adapter's text limit. The cause is not classified yet, so
    ``others_mismatch`` is always True.
    """

    global_steps: int
    rollout_id: str
    data_id: str
    turn_index: int
    template_mismatch: bool
    retoken_mismatch: bool
    others_mismatch: bool
    prompt_length: int
    response_length: int
    previous_trace_length: int
    current_trace_length: int
    previous_trace: str
    current_trace: str


class MismatchSink(Protocol):
    """Receives one step's mismatch entries (already capped in number and text length)."""

    def write(self, entries: Sequence[MismatchEntry], global_steps: int) -> None: ...


class LogMismatchSink:
    """Logs a WARNING summary per step and each entry as one INFO line of JSON."""

    def write(self, entries: Sequence[MismatchEntry], global_steps: int) -> None:
        logger.warning("step %d: %d trace-merge mismatch entries", global_steps, len(entries))
        for entry in entries:
            logger.info("trace-merge mismatch: %s", json.dumps(entry, ensure_ascii=False))


class JsonlMismatchSink:
    """Appends each entry as one JSON line to ``path`` (parent folders created)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def write(self, entries: Sequence[MismatchEntry], global_steps: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as file:
            for entry in entries:
                file.write(json.dumps(entry, ensure_ascii=False) + "\n")


class WandbMismatchSink:
    """Logs a ``wandb.Table`` with ``MISMATCH_COLUMNS`` under ``training/trace_merge_mismatches``.

    wandb is imported on first write; with no active run nothing is logged.
    """

    key = "training/trace_merge_mismatches"

    def write(self, entries: Sequence[MismatchEntry], global_steps: int) -> None:
        import wandb

        if wandb.run is None:
            return
        table = wandb.Table(columns=list(MISMATCH_COLUMNS))
        for entry in entries:
            table.add_data(*(entry[column] for column in MISMATCH_COLUMNS))
        wandb.log({self.key: table}, step=global_steps)


def wandb_run_active() -> bool:
    """Whether a wandb run is active, without importing wandb when nobody has."""
    wandb: Any = sys.modules.get("wandb")
    return wandb is not None and getattr(wandb, "run", None) is not None


def default_mismatch_sink() -> MismatchSink:
    """wandb when a run is active now, else the log (chosen per step: wandb is often started late)."""
    return WandbMismatchSink() if wandb_run_active() else LogMismatchSink()


def decode_ids(tokenizer: Any | None, ids: list[int]) -> str:
    """``tokenizer.decode(ids, skip_special_tokens=False)``; ids joined by spaces without a usable tokenizer."""
    if tokenizer is not None:
        try:
            return str(tokenizer.decode(ids, skip_special_tokens=False))
        except TypeError:
            try:
                return str(tokenizer.decode(ids))
            except Exception:
                logger.debug("tokenizer.decode failed; falling back to ids", exc_info=True)
        except Exception:
            logger.debug("tokenizer.decode failed; falling back to ids", exc_info=True)
    return " ".join(str(i) for i in ids)


def cap_text(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters plus a note of how many were cut."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n...[truncated {len(text) - limit} chars]"


__all__ = (
    "MISMATCH_COLUMNS",
    "JsonlMismatchSink",
    "LogMismatchSink",
    "MismatchEntry",
    "MismatchSink",
    "WandbMismatchSink",
    "cap_text",
    "decode_ids",
    "default_mismatch_sink",
    "wandb_run_active",
)
