"""agl's state in a checkpoint folder (``agl_state.json``): read from the folder it was saved in,
and refused in one line when it names another step than the checkpoint it lies in."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from agl_rollout import AsyncRolloutState
from agl_trainer.errors import CheckpointStateMismatch
from agl_trainer.run_state import STATE_FILE, RunState


def test_a_checkpoints_state_is_read_from_its_own_folder_wherever_that_lies(tmp_path: Path) -> None:
    saved = RunState(5, AsyncRolloutState(cursor=7), [{"x": 3}], run_id="dead")
    saved.save(tmp_path / "elsewhere", 4)
    assert RunState.load(tmp_path / "elsewhere" / "global_step_4", 4) == saved


def test_a_state_copied_next_to_another_checkpoint_is_refused_in_one_line_naming_both_steps(
    tmp_path: Path,
) -> None:
    RunState(3, AsyncRolloutState(), run_id="dead").save(tmp_path, 3)
    (tmp_path / "global_step_4").mkdir()
    shutil.copy(tmp_path / "global_step_3" / STATE_FILE, tmp_path / "global_step_4" / STATE_FILE)
    with pytest.raises(CheckpointStateMismatch) as refused:
        RunState.load(tmp_path / "global_step_4", 4)
    line = str(refused.value)
    assert "\n" not in line
    assert f"{tmp_path / 'global_step_4' / STATE_FILE} is agl's state of step 3" in line
    assert "the checkpoint of step 4" in line
