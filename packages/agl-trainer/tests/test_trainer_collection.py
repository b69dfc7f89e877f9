"""The trainer's rollout side (:class:`~agl_trainer.step.collection.Collection`) against the real
agl-server, with agl-rollout's test agents: when the hooks run, and what every exit leaves behind.

No Ray and no verl workers: the collection is driven as ``fit`` drives it (validate, start, take,
stop), and the Ctrl-Cs are real SIGINTs to this process.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agl_rollout import AglClient, BatchTopUp
from agl_testing.agents import AgentBehaviour, FakeAgents
from agl_testing.agl_server import TEST_KEY, AglServerProcess, once_it_holds_a_rollout
from agl_testing.collector import wait_polls
from agl_trainer.assembly import compose_config
from agl_trainer.serving.drain import Drain
from agl_trainer.settings import parse_settings
from agl_trainer.step.collection import Collection

pytestmark = [pytest.mark.verl, pytest.mark.server, pytest.mark.timeout(180)]

FULLY_ASYNC = "agentlightning.fully_async.enabled=true"
VAL_BATCHES = [{"x": [100, 101]}, {"x": [102, 103]}]

HOOKS = '''
import threading
import time
from pathlib import Path

from agl_rollout import RolloutHooks

LOG = Path({log!r})


class Recording(RolloutHooks):
    """Logs each call, and whether another hook call was running at the same time."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._active = 0
        self.judge = None

    def on_startup(self, store=None) -> None:
        self.judge = "open"  # a judge client or a database, opened once
        self._log("startup")

    def on_succeeded(self, rollout, events, store) -> None:
        with self._guard:
            self._active += 1
            overlapped = self._active > 1
        time.sleep({sleep_s})
        with self._guard:
            self._active -= 1
        kind = "train" if rollout.is_train else "val"
        self._log(f"{{kind}} judge={{self.judge}} overlapped={{overlapped}}")

    def _log(self, line: str) -> None:
        with self._guard, LOG.open("a") as log:
            log.write(line + "\\n")
'''


def _collection(
    server: AglServerProcess, tmp_path: Path, *overrides: str, sleep_s: float = 0.0
) -> Collection:
    hooks = tmp_path / "hooks.py"
    hooks.write_text(HOOKS.format(log=str(tmp_path / "hooks.log"), sleep_s=sleep_s))
    config = compose_config(
        [
            f"agentlightning.agl_base_url={server.url}",
            f"agentlightning.agl_key={TEST_KEY}",
            "agentlightning.external_servers.endpoints=[http://127.0.0.1:9/v1]",
            "agentlightning.poll_interval_seconds=0.05",
            f"agentlightning.hooks={hooks}",
            "actor_rollout_ref.rollout.n=2",
            "data.train_batch_size=2",
            *overrides,
        ]
    )
    settings = parse_settings(config)

    def epoch() -> Iterator[dict[str, Any]]:
        return iter([{"x": [0, 1]}, {"x": [2, 3]}, {"x": [4, 5]}, {"x": [6, 7]}])

    client = AglClient(settings.server.base_url, settings.server.key)
    return Collection(
        client, settings.pipeline, top_up=BatchTopUp(epoch), drain=Drain.from_settings(settings.server.drain)
    )


def _hook_log(tmp_path: Path) -> list[str]:
    return (tmp_path / "hooks.log").read_text().splitlines()


def _paused(collection: Collection) -> bool:
    return collection.client.proxy_state().paused


def test_on_startup_runs_once_before_the_first_validation_rollout(
    agl_server: AglServerProcess, tmp_path: Path
) -> None:
    collection = _collection(agl_server, tmp_path)
    with FakeAgents(agl_server.url, behaviour=AgentBehaviour(reward=1.0)):
        _, metrics = collection.val_rollouts(VAL_BATCHES, step=0)
        collection.start(steps_done=0)
        collection.take(step=1, trained_version=0)
        collection.stop()
    log = _hook_log(tmp_path)
    assert log[0] == "startup"
    assert (
        sorted(log[1:]) == ["train judge=open overlapped=False"] * 4 + ["val judge=open overlapped=False"] * 4
    )
    assert metrics["val/n_hook_errors"] == 0.0


def test_hooks_are_never_called_concurrently_by_validation_and_the_collector(
    agl_server: AglServerProcess, tmp_path: Path
) -> None:
    # Fully async: the collector's groups complete (and are hooked on its thread) while the main
    # thread waits for validation rollouts (hooked on it), the agents finishing both together.
    collection = _collection(agl_server, tmp_path, FULLY_ASYNC, sleep_s=0.1)
    with FakeAgents(agl_server.url, behaviour=AgentBehaviour(reward=1.0, delay_s=0.5)):
        collection.start(steps_done=0)
        collection.val_rollouts(VAL_BATCHES[:1], step=0)
        collection.take(step=1, trained_version=0)
        collection.stop()
    log = _hook_log(tmp_path)
    assert "val judge=open overlapped=False" in log
    assert [line for line in log if "overlapped=True" in line] == []


def test_a_run_that_only_validated_leaves_the_gateway_resumed(
    agl_server: AglServerProcess, tmp_path: Path
) -> None:
    collection = _collection(agl_server, tmp_path)
    collection.client.pause("publish v0")  # the first publish pauses it in the sync modes
    with FakeAgents(agl_server.url, behaviour=AgentBehaviour(reward=1.0)):
        collection.val_rollouts(VAL_BATCHES, step=0)
    assert _paused(collection)  # drained after the wait, as after every sync wait
    collection.stop()  # what fit's val_only return runs
    assert not _paused(collection)


def test_a_failed_first_publish_leaves_the_gateway_resumed(
    agl_server: AglServerProcess, tmp_path: Path
) -> None:
    collection = _collection(agl_server, tmp_path)
    collection.client.pause("publish v0")  # the publish paused it, then its push failed
    collection.stop()
    assert not _paused(collection)


def test_ctrl_c_during_validation_cancels_its_rollouts_and_resumes_the_gateway(
    agl_server: AglServerProcess, tmp_path: Path
) -> None:
    collection = _collection(agl_server, tmp_path)
    # No agent runs them: the validation wait is still waiting when Ctrl-C comes.
    once_it_holds_a_rollout(agl_server, lambda: signal.raise_signal(signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        collection.val_rollouts(VAL_BATCHES, step=0)
    assert len(agl_server.rollout_ids()) >= 1
    collection.stop()
    assert agl_server.rollout_ids() == []
    assert not _paused(collection)


def test_a_second_ctrl_c_during_the_stop_still_cancels_every_rollout_and_resumes_the_gateway(
    agl_server: AglServerProcess, tmp_path: Path
) -> None:
    collection = _collection(agl_server, tmp_path)
    collection.start(steps_done=0)  # no agent: its groups stay queued
    assert collection.collector is not None
    wait_polls(collection.collector, 2, timeout_s=30)
    assert len(agl_server.rollout_ids()) == 4
    manager = collection.collector.manager
    cancel_pending = manager.cancel_pending

    def cancel_after_a_second_ctrl_c(reason: str) -> int:
        signal.raise_signal(signal.SIGINT)  # the user presses Ctrl-C again while the run stops
        return cancel_pending(reason)

    manager.cancel_pending = cancel_after_a_second_ctrl_c  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        collection.stop()
    assert agl_server.rollout_ids() == []
    assert not _paused(collection)
