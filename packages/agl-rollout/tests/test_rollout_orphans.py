"""A resumed run cancels the rollouts its dead predecessor left on the real agl-server, and no one else's."""

from __future__ import annotations

import uuid

import pytest

from agl_rollout import AglClient
from agl_rollout.orphans import cancel_orphans
from agl_testing.agl_server import TEST_KEY, AglServerProcess
from agl_types import RolloutCreate, RolloutState, RolloutStatusPatch

pytestmark = [pytest.mark.server, pytest.mark.timeout(120)]


def _create(client: AglClient, name: str) -> str:
    [rollout] = client.create_rollouts([RolloutCreate(input={"name": name}, rollout_id=uuid.uuid4().hex)])
    return rollout.rollout_id


def test_a_resumed_run_cancels_what_its_dead_run_left_but_the_checkpoints_rollouts_and_other_runs(
    fresh_agl_server: AglServerProcess,
) -> None:
    with (
        AglClient(fresh_agl_server.url, TEST_KEY, run_id="dead") as dead,
        AglClient(fresh_agl_server.url, TEST_KEY, run_id="other") as other,
        AglClient(fresh_agl_server.url, TEST_KEY) as untagged,
        AglClient(fresh_agl_server.url, TEST_KEY, run_id="resumed") as resumed,
    ):
        held, _queued, running, finished = (
            _create(dead, name) for name in ("held", "queued", "running", "done")
        )
        dead.patch_rollout_status(running, RolloutStatusPatch(state=RolloutState.RUNNING))
        dead.patch_rollout_status(finished, RolloutStatusPatch(state=RolloutState.RUNNING))
        dead.patch_rollout_status(finished, RolloutStatusPatch(state=RolloutState.SUCCEEDED))
        others = {_create(other, "other"), _create(untagged, "untagged"), _create(resumed, "own")}

        n = cancel_orphans(resumed, "dead", keep={held})

        left = {r.rollout_id: r for r in resumed.list_rollouts(list(RolloutState), limit=100)}
    assert n == 3
    assert set(left) == {held, *others}
    assert left[held].metadata.run_id == "dead"
    assert {left[rid].metadata.run_id for rid in others} == {"other", None, "resumed"}
