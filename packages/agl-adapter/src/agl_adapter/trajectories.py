"""Per-step trajectory artifacts: what each rollout saw and said, for reading a run after the fact.

One compact record per rollout (its last model call's ids and decoded text, its reward, state,
and whether its turns broke the trajectory merge), and the step's trace-merge mismatch entries,
each kind written as a zipped JSON-lines file ``step_<N>/<kind>.jsonl.zip`` under a folder and,
while a wandb run is active, logged as a wandb artifact of type ``<kind>`` named as Agent
Lightning 1.0.2 names its trajectory artifacts (``train-trajectories-<run id>-step-<N>``). As in
1.0.2, each step's trajectory artifact is also indexed by a one-row wandb table
(``training/rollout_trajectories``, ``val/rollout_trajectories``), so the wandb UI finds the zip
from the step.
"""

from __future__ import annotations

import io
import json
import logging
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, TypedDict

from agl_adapter.mismatch import cap_text, decode_ids, wandb_run_active
from agl_types import CompletedRollout

logger = logging.getLogger("agl_adapter")

TRAIN_TRAJECTORIES = "train_trajectories"
VALIDATION_TRAJECTORIES = "validation_trajectories"
TRACE_MERGE_MISMATCHES = "trace_merge_mismatches"

MismatchClass = Literal["none", "others"]

TRAJECTORY_INDEX_COLUMNS = ("global_steps", "trajectory_artifact", "trajectory_artifact_path", "row_count")
_TRAJECTORY_INDEX_KEYS = {
    TRAIN_TRAJECTORIES: "training/rollout_trajectories",
    VALIDATION_TRAJECTORIES: "val/rollout_trajectories",
}


class TrajectoryRecord(TypedDict):
    """One rollout, compactly. ``prompt_ids``/``response_ids`` are its last model call's (in a
    multi-turn rollout the last prompt holds the turns before it); ``prompt``/``response`` are
    those decoded and capped. ``reward`` is filled with ``reward_fillna_value`` when the agent
    reported none (``has_reward`` says which). ``mismatch`` is ``"others"`` when a turn did not
    continue the one before (the step's first entries are in ``trace_merge_mismatches``),
    ``"none"`` otherwise (also for a rollout without triplets, or a failed one dropped before
    merging), and ``None`` at transition level, where turns are never merged. Failed and
    traceless rollouts get a record too (the reference skips them).
    """

    global_steps: int
    rollout_id: str
    data_id: str
    state: str
    error_message: str | None
    reward: float
    has_reward: bool
    n_turns: int
    prompt_ids: list[int]
    response_ids: list[int]
    prompt: str
    response: str
    mismatch: MismatchClass | None


def trajectory_records(
    rollouts: Sequence[CompletedRollout],
    *,
    global_steps: int,
    tokenizer: Any | None,
    reward_fillna_value: float,
    mismatched: frozenset[str] | None,
    max_text_chars: int,
    limit: int | None = None,
) -> list[TrajectoryRecord]:
    """Records of ``rollouts`` in (step, sample index) order, at most ``limit`` of them.

    ``mismatched``: ids of the rollouts whose turns broke the merge; None when none was attempted.
    """
    ordered = sorted(rollouts, key=lambda r: (r.step, r.sample_idx_in_step))
    records: list[TrajectoryRecord] = []
    for rollout in ordered[:limit]:
        last = rollout.triplets[-1] if rollout.triplets else None
        prompt_ids = list(last.prompt_token_ids) if last else []
        response_ids = list(last.response_token_ids) if last else []
        records.append(
            TrajectoryRecord(
                global_steps=global_steps,
                rollout_id=rollout.rollout_id,
                data_id=rollout.data_id,
                state=rollout.rollout_state.value,
                error_message=rollout.error_message,
                reward=reward_fillna_value if rollout.final_reward is None else rollout.final_reward,
                has_reward=rollout.final_reward is not None,
                n_turns=len(rollout.triplets),
                prompt_ids=prompt_ids,
                response_ids=response_ids,
                prompt=cap_text(decode_ids(tokenizer, prompt_ids), max_text_chars),
                response=cap_text(decode_ids(tokenizer, response_ids), max_text_chars),
                mismatch=None
                if mismatched is None
                else ("others" if rollout.rollout_id in mismatched else "none"),
            )
        )
    return records


def zipped_jsonl(records: Sequence[Mapping[str, Any]], member: str) -> bytes:
    """A deflated zip archive holding one file, ``member``: one JSON object per line."""
    text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, mode="w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(member, text)
    return buffer.getvalue()


class ArtifactSink(Protocol):
    """Receives one step's records of one kind (``train_trajectories``, ``validation_trajectories``,
    ``trace_merge_mismatches``)."""

    def write(self, kind: str, records: Sequence[Mapping[str, Any]], global_steps: int) -> None: ...


class ZippedJsonlArtifacts:
    """Writes ``<folder>/step_<N>/<kind>.jsonl.zip``; while a wandb run is active, also logs that
    file as the artifact ``<kind with dashes>-<run id>-step-<N>`` of type ``<kind>``, and for the
    trajectory kinds a table with ``TRAJECTORY_INDEX_COLUMNS`` at step N: the artifact's name, its
    path inside the artifact and its record count.

    A failed upload is logged and the run goes on; the local file is already written.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    def path(self, kind: str, global_steps: int) -> Path:
        return self.folder / f"step_{global_steps}" / f"{kind}.jsonl.zip"

    def write(self, kind: str, records: Sequence[Mapping[str, Any]], global_steps: int) -> None:
        path = self.path(kind, global_steps)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(zipped_jsonl(records, f"{kind}.jsonl"))
        if wandb_run_active():
            try:
                _log_wandb_artifact(path, kind, len(records), global_steps)
            except Exception:
                logger.exception(
                    "step %d: uploading %s to wandb failed; it stays at %s", global_steps, kind, path
                )


def _log_wandb_artifact(path: Path, kind: str, n_records: int, global_steps: int) -> None:
    import wandb

    run: Any = wandb.run
    name = f"{kind.replace('_', '-')}-{_safe_name(run.id)}-step-{global_steps}"
    path_in_artifact = f"step_{global_steps}/{path.name}"
    metadata = {"global_steps": global_steps, "row_count": n_records, "format": "jsonl.zip"}
    artifact = wandb.Artifact(name=name, type=kind, metadata=metadata)
    artifact.add_file(str(path), name=path_in_artifact)
    run.log_artifact(artifact)
    index_key = _TRAJECTORY_INDEX_KEYS.get(kind)
    if index_key is not None:
        table = wandb.Table(columns=list(TRAJECTORY_INDEX_COLUMNS))
        table.add_data(global_steps, name, path_in_artifact, n_records)
        wandb.log({index_key: table}, step=global_steps)


def _safe_name(value: object) -> str:
    """``value`` with every character wandb refuses in artifact names replaced by ``_``."""
    text = "".join(c if c.isascii() and (c.isalnum() or c in "-_.") else "_" for c in str(value))
    return text or "run"


__all__ = (
    "TRACE_MERGE_MISMATCHES",
    "TRAIN_TRAJECTORIES",
    "TRAJECTORY_INDEX_COLUMNS",
    "VALIDATION_TRAJECTORIES",
    "ArtifactSink",
    "MismatchClass",
    "TrajectoryRecord",
    "ZippedJsonlArtifacts",
    "trajectory_records",
    "zipped_jsonl",
)
