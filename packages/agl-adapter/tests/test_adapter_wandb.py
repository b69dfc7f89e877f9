"""agl-adapter's wandb outputs against real wandb, in offline mode (a run on disk, nothing sent):
the mismatch table, the per-step trajectory artifacts and the tables indexing them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agl_adapter import (
    MISMATCH_COLUMNS,
    TRAJECTORY_INDEX_COLUMNS,
    LogMismatchSink,
    MismatchEntry,
    WandbMismatchSink,
    ZippedJsonlArtifacts,
    default_mismatch_sink,
)
from agl_testing.requirements import import_optional

wandb = import_optional("wandb")


def _entry() -> MismatchEntry:
    return MismatchEntry(
        global_steps=3,
        rollout_id="r1",
        data_id="d1",
        turn_index=1,
        template_mismatch=False,
        retoken_mismatch=False,
        others_mismatch=True,
        prompt_length=1,
        response_length=2,
        previous_trace_length=3,
        current_trace_length=4,
        previous_trace="ü",
        current_trace="b",
    )


@pytest.fixture
def offline_run(tmp_path: Path) -> Iterator[Any]:
    run = wandb.init(mode="offline", dir=tmp_path, project="agl-tests", settings=wandb.Settings(silent=True))
    try:
        yield run
    finally:
        run.finish()


@pytest.fixture
def logged_steps(monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """The ``step`` of each call to the real ``wandb.log`` (a spy: every call goes through)."""
    steps: list[int | None] = []
    log = wandb.log

    def spy(data: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        steps.append(step)
        log(data, step=step, **kwargs)

    monkeypatch.setattr(wandb, "log", spy)
    return steps


def _tables_on_disk(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Each table the run saved, by its key (wandb names the file ``media/table/<key>_<n>_<hash>``)."""
    tables: dict[str, dict[str, Any]] = {}
    for path in run_dir.rglob("*.table.json"):
        key = str(path.relative_to(run_dir / "media" / "table")).rsplit("_", 2)[0]
        tables[key] = json.loads(path.read_text(encoding="utf-8"))
    return tables


def test_wandb_sink_logs_a_table_with_the_reference_columns_at_the_step(
    offline_run: Any, logged_steps: list[int | None]
) -> None:
    WandbMismatchSink().write([_entry()], 9)
    offline_run.finish()
    assert logged_steps == [9]
    assert _tables_on_disk(Path(offline_run.dir)) == {
        "training/trace_merge_mismatches": {
            "columns": list(MISMATCH_COLUMNS),
            "data": [[3, "r1", "d1", 1, False, False, True, 1, 2, 3, 4, "ü", "b"]],
        }
    }


def test_wandb_sink_without_run_logs_nothing(logged_steps: list[int | None]) -> None:
    assert wandb.run is None
    WandbMismatchSink().write([_entry()], 9)
    assert logged_steps == []


def test_default_sink_is_wandb_only_with_an_active_run(tmp_path: Path) -> None:
    assert wandb.run is None
    assert isinstance(default_mismatch_sink(), LogMismatchSink)
    run = wandb.init(mode="offline", dir=tmp_path, project="agl-tests", settings=wandb.Settings(silent=True))
    try:
        assert isinstance(default_mismatch_sink(), WandbMismatchSink)
    finally:
        run.finish()
    assert isinstance(default_mismatch_sink(), LogMismatchSink)


def test_an_active_run_gets_each_written_file_as_an_artifact_of_its_kind(
    offline_run: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    logged: list[Any] = []
    log_artifact = offline_run.log_artifact

    def spy(artifact: Any, *args: Any, **kwargs: Any) -> Any:
        logged.append(artifact)
        return log_artifact(artifact, *args, **kwargs)

    monkeypatch.setattr(offline_run, "log_artifact", spy)
    artifacts = ZippedJsonlArtifacts(tmp_path / "trajectories")
    artifacts.write("train_trajectories", [{"rollout_id": "r1"}, {"rollout_id": "r2"}], 7)
    [artifact] = [a for a in logged if a.type != "run_table"]  # wandb stores a logged table as one too
    assert artifact.name == f"train-trajectories-{offline_run.id}-step-7"  # Agent Lightning 1.0.2's name
    assert artifact.type == "train_trajectories"
    assert artifact.metadata == {"global_steps": 7, "row_count": 2, "format": "jsonl.zip"}
    [entry] = artifact.manifest.entries.values()
    local = tmp_path / "trajectories" / "step_7" / "train_trajectories.jsonl.zip"
    assert entry.path == "step_7/train_trajectories.jsonl.zip"
    assert entry.size == local.stat().st_size


def test_without_a_run_only_the_file_is_written(tmp_path: Path) -> None:
    assert wandb.run is None
    ZippedJsonlArtifacts(tmp_path).write("validation_trajectories", [{"rollout_id": "r1"}], 2)
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.zip")] == [
        "step_2/validation_trajectories.jsonl.zip"
    ]


def test_each_trajectory_artifact_is_indexed_by_the_references_table_at_its_step(
    offline_run: Any, tmp_path: Path, logged_steps: list[int | None]
) -> None:
    """Agent Lightning 1.0.2's ``training/rollout_trajectories`` and ``val/rollout_trajectories``: one
    row naming the step's artifact, the file's path in it and its record count; mismatches get none."""
    artifacts = ZippedJsonlArtifacts(tmp_path / "trajectories")
    artifacts.write("train_trajectories", [{"rollout_id": "r1"}, {"rollout_id": "r2"}], 7)
    artifacts.write("validation_trajectories", [{"rollout_id": "r3"}], 7)
    artifacts.write("trace_merge_mismatches", [{"rollout_id": "r1"}], 7)
    offline_run.finish()
    assert logged_steps == [7, 7]
    assert TRAJECTORY_INDEX_COLUMNS == (
        "global_steps",
        "trajectory_artifact",
        "trajectory_artifact_path",
        "row_count",
    )
    assert _tables_on_disk(Path(offline_run.dir)) == {
        "training/rollout_trajectories": {
            "columns": list(TRAJECTORY_INDEX_COLUMNS),
            "data": [
                [7, f"train-trajectories-{offline_run.id}-step-7", "step_7/train_trajectories.jsonl.zip", 2]
            ],
        },
        "val/rollout_trajectories": {
            "columns": list(TRAJECTORY_INDEX_COLUMNS),
            "data": [
                [
                    7,
                    f"validation-trajectories-{offline_run.id}-step-7",
                    "step_7/validation_trajectories.jsonl.zip",
                    1,
                ]
            ],
        },
    }
