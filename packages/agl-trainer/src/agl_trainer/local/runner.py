"""A local stand-in for ``agl-controller``: run agents in a thread pool for queued rollouts.

For each queuing rollout on the server it does what the controller and the agent's harness do
together: claim it (``PATCH`` to running with ``last_attempt_id="0"``; a 409 means someone else
got it), run the agent with a model bound to that rollout's gateway URL, post the returned
reward as a ``reward`` event, and finish it (``succeeded``, or ``failed`` with the exception as
``error_message``). At most ``workers`` rollouts run at once; the rest stay queuing.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import httpx

from agl_trainer.local.agent import Agent, AgentContext, GatewayModel, RunnerStoppedError, proxy_base_url
from agl_trainer.local.server_api import AglServerApi

ATTEMPT_ID = "0"
log = logging.getLogger(__name__)


@dataclass
class RunnerStats:
    """Counts of finished rollouts since the runner started; ``stopped`` counts those abandoned
    because the runner stopped while they waited on a paused gateway (also marked failed on the
    server, but no agent went wrong)."""

    succeeded: int = 0
    failed: int = 0
    stopped: int = 0


class LocalAgentRunner:
    """Poll the server for queuing rollouts and run ``agent`` on each, ``workers`` at a time."""

    def __init__(
        self,
        api: AglServerApi,
        agent: Agent,
        *,
        workers: int = 4,
        poll_interval: float = 0.2,
        model_timeout: float = 300.0,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers} must be >= 1")
        self.api = api
        self.agent = agent
        self.workers = workers
        self.poll_interval = poll_interval
        self.stats = RunnerStats()
        self._model_http = httpx.Client(headers=api.http.headers, timeout=model_timeout)
        self._slots = threading.Semaphore(workers)
        self._stats_lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agl-agent")
        self._poller = threading.Thread(target=self._poll_loop, name="agl-runner-poll", daemon=True)

    def start(self) -> LocalAgentRunner:
        self._poller.start()
        return self

    def stop(self, wait: bool = True) -> None:
        """Stop claiming rollouts; with ``wait`` also let running agents finish (an agent waiting on
        a paused gateway gives up at once and its rollout is marked failed)."""
        self._stop.set()
        if self._poller.is_alive():
            self._poller.join()
        self._pool.shutdown(wait=wait, cancel_futures=True)
        self._model_http.close()

    def __enter__(self) -> LocalAgentRunner:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop(wait=exc_type is None)

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            try:
                claimed = self._claim_some()
            except httpx.TransportError as exc:  # agl-server unreachable: no bug to trace
                log.warning("local runner: polling agl-server failed (%r); retrying", exc)
                claimed = 0
            except Exception:
                log.exception("local runner: polling agl-server failed; retrying")
                claimed = 0
            if claimed == 0:
                self._stop.wait(self.poll_interval)

    def _claim_some(self) -> int:
        claimed = 0
        for rollout in self.api.list_rollouts(["queuing"], limit=self.workers):
            if self._stop.is_set() or not self._slots.acquire(blocking=False):
                break
            patched = self.api.patch_status(
                rollout["rollout_id"], state="running", last_attempt_id=ATTEMPT_ID
            )
            if patched is None:
                self._slots.release()
                continue
            self._pool.submit(self._run_one, patched)
            claimed += 1
        return claimed

    def _run_one(self, rollout: dict[str, Any]) -> None:
        rollout_id = str(rollout["rollout_id"])
        is_train = bool(rollout.get("is_train", True))
        try:
            base = proxy_base_url(self.api.url, rollout_id, ATTEMPT_ID, "train" if is_train else "val")
            context = AgentContext(
                rollout_id=rollout_id,
                input=rollout.get("input"),
                is_train=is_train,
                model=GatewayModel(self._model_http, base, stopping=self._stop),
                metadata=dict(rollout.get("metadata") or {}),
            )
            try:
                reward = float(self.agent(context))
                self.api.post_event(rollout_id, ATTEMPT_ID, "reward", {"value": reward, "source": "agent"})
                self.api.patch_status(rollout_id, state="succeeded")
                self._count("succeeded")
            except Exception as exc:
                # An agent cut off by the runner's stop (the run is over or failed) went nowhere wrong.
                stopped = isinstance(exc, RunnerStoppedError) or self._stop.is_set()
                if not stopped:
                    log.warning("local runner: rollout %s failed: %r", rollout_id, exc)
                self.api.patch_status(
                    rollout_id, state="failed", error_message=f"{type(exc).__name__}: {exc}"
                )
                self._count("stopped" if stopped else "failed")
        except httpx.TransportError as exc:  # agl-server unreachable: no bug to trace
            if not self._stop.is_set():
                log.warning("local runner: could not report rollout %s to agl-server: %r", rollout_id, exc)
        except Exception:
            if not self._stop.is_set():  # once stopped, agl-server may be gone: nothing to report to
                log.exception("local runner: could not report rollout %s to agl-server", rollout_id)
        finally:
            self._slots.release()

    def _count(self, outcome: Literal["succeeded", "failed", "stopped"]) -> None:
        with self._stats_lock:
            setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)
