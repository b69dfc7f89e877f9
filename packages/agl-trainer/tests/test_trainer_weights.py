"""The external-server weight push: what it does when the servers already hold the weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from agl_trainer.local.errors import WeightPushError
from agl_trainer.weights import ExternalVllmPush

pytestmark = pytest.mark.verl

# Port 9 (discard) on loopback: a push that tried to reach this server would fail.
_UNREACHABLE = "http://127.0.0.1:9/v1"


def test_pushing_the_version_the_servers_serve_saves_and_reloads_nothing(tmp_path: Path) -> None:
    pusher = ExternalVllmPush([_UNREACHABLE], "m", tmp_path / "weights")
    no_workers = cast(Any, object())  # a push that saved weights would call no_workers.save_hf_weights
    assert pusher.push(no_workers, 0) == {"training/weight_version": 0.0}
    assert not (tmp_path / "weights").exists()


def test_a_new_version_is_saved_then_an_unreachable_server_is_named(tmp_path: Path) -> None:
    saved: list[Path] = []

    class SavingWorkers:
        def save_hf_weights(self, path: Path) -> Path:
            saved.append(Path(path))
            return Path(path)

    pusher = ExternalVllmPush([_UNREACHABLE], "m", tmp_path / "weights")
    with pytest.raises(WeightPushError, match=r"version 3 .* at http://127\.0\.0\.1:9/v1"):
        pusher.push(cast(Any, SavingWorkers()), 3)
    assert saved == [tmp_path / "weights" / "step_3"]
    assert pusher.served_version == 0
