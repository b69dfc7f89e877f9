"""What agl adds to verl's checkpoint folder: the weight version, the collector's held groups and
the loader samples cut off but not yet handed out.

It is written before verl writes its files, so verl's ``latest_checkpointed_iteration.txt`` never
points at a folder without it; a checkpoint of verl alone resumes at the version ``global_steps``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agl_rollout import AsyncRolloutState

STATE_FILE = "agl_state.json"


@dataclass(frozen=True)
class RunState:
    weight_version: int
    async_state: AsyncRolloutState | None
    leftover_samples: list[dict[str, Any]] = field(default_factory=list[dict[str, Any]])

    def save(self, checkpoint_dir: Path, step: int) -> None:
        """Write the state into verl's folder of the checkpoint of ``step`` under ``checkpoint_dir``
        (created when missing), atomically."""
        held = self.async_state.model_dump(mode="json") if self.async_state is not None else None
        folder = checkpoint_dir / f"global_step_{step}"
        folder.mkdir(parents=True, exist_ok=True)
        body = {
            "weight_version": self.weight_version,
            "async_state": held,
            "leftover_samples": self.leftover_samples,
        }
        partial = folder / f"{STATE_FILE}.partial"
        partial.write_text(json.dumps(body))
        partial.replace(folder / STATE_FILE)

    @classmethod
    def load(cls, checkpoint_dir: Path, step: int) -> RunState | None:
        """The state saved with the checkpoint of ``step``; None at step 0 (a fresh run) or when the
        folder has none (a checkpoint of verl alone)."""
        path = checkpoint_dir / f"global_step_{step}" / STATE_FILE
        if not step or not path.exists():
            return None
        state = json.loads(path.read_text())
        held = state["async_state"]
        return cls(
            weight_version=int(state["weight_version"]),
            async_state=AsyncRolloutState.model_validate(held) if held is not None else None,
            leftover_samples=list(state.get("leftover_samples") or []),
        )


__all__ = ("STATE_FILE", "RunState")
