"""What agl adds to verl's checkpoint folder: the weight version, the collector's held groups,
the loader samples cut off but not yet handed out, and the run id its rollouts carry.

It is written before verl writes its files, so verl's ``latest_checkpointed_iteration.txt`` never
points at a folder without it; a checkpoint of verl alone resumes at the version ``global_steps``.
It is read from the folder verl resumes from (``trainer.resume_from_path`` too), and it names its
step, so a state copied next to another checkpoint is refused, not trained on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agl_rollout import AsyncRolloutState
from agl_trainer.errors import CheckpointStateMismatch

STATE_FILE = "agl_state.json"


@dataclass(frozen=True)
class RunState:
    """``run_id``: the id the saving run tagged its rollouts with (:class:`agl_rollout.AglClient`)."""

    weight_version: int
    async_state: AsyncRolloutState | None
    leftover_samples: list[dict[str, Any]] = field(default_factory=list[dict[str, Any]])
    run_id: str | None = None

    def save(self, checkpoint_dir: Path, step: int) -> None:
        """Write the state into verl's folder of the checkpoint of ``step`` under ``checkpoint_dir``
        (created when missing), atomically."""
        held = self.async_state.model_dump(mode="json") if self.async_state is not None else None
        folder = checkpoint_dir / f"global_step_{step}"
        folder.mkdir(parents=True, exist_ok=True)
        body = {
            "step": step,
            "run_id": self.run_id,
            "weight_version": self.weight_version,
            "async_state": held,
            "leftover_samples": self.leftover_samples,
        }
        partial = folder / f"{STATE_FILE}.partial"
        partial.write_text(json.dumps(body))
        partial.replace(folder / STATE_FILE)

    @classmethod
    def load(cls, folder: Path, step: int) -> RunState | None:
        """The state saved in the checkpoint ``folder`` of ``step``; None when it has none (a
        checkpoint of verl alone). Raises :class:`CheckpointStateMismatch` when the state names
        another step."""
        path = folder / STATE_FILE
        if not path.exists():
            return None
        state = json.loads(path.read_text())
        if state.get("step") != step:
            raise CheckpointStateMismatch(
                f"{path} is agl's state of step {state.get('step')}, but it lies in the checkpoint of step "
                f"{step}: resuming with it would carry another step's groups on. Resume from the checkpoint "
                f"it was saved with, or delete it to resume from verl's files alone"
            )
        held = state["async_state"]
        return cls(
            weight_version=int(state["weight_version"]),
            async_state=AsyncRolloutState.model_validate(held) if held is not None else None,
            leftover_samples=list(state.get("leftover_samples") or []),
            run_id=state.get("run_id"),
        )


__all__ = ("STATE_FILE", "RunState")
