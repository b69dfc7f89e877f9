"""Watch the embedded default's processes while it trains.

agl-server and the CPU vLLM server are vital: when one exits, the run stops within a second (the
supervisor interrupts the main thread as Ctrl-C does) and :attr:`Supervisor.failure` says which
process died, its exit code and its log. That interrupt is heard even when the process was started
with SIGINT ignored (:func:`agl_trainer.interrupts.hear_ctrl_c`, while the supervisor runs). agl-controller is restarted instead, at most
``max_restarts`` times, each one counted and logged; the new controller fails the rollouts the dead
one was running, and the trainer handles them as any failed rollout. With several vLLM servers
(:meth:`Supervisor.watch_vllm`), a dead one is restarted likewise, at most ``max_vllm_restarts``
times in all: the trainer's fleet (:mod:`agl_trainer.serving.fleet`) took it out of the gateway and
registers it again once it answers at the current weights. A process being stopped on purpose
(:meth:`ChildProcess.stop`) is not a death.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from agl_trainer.interrupts import SigintHandler, hear_ctrl_c
from agl_trainer.local.controller import AglController
from agl_trainer.local.processes import ChildProcess
from agl_trainer.local.services import VllmServer

DEFAULT_CONTROLLER_RESTARTS = 3
DEFAULT_VLLM_RESTARTS = 3
DEFAULT_INTERVAL_SECONDS = 0.5
log = logging.getLogger(__name__)


def interrupt_main_thread() -> None:
    """SIGINT to the main thread: a blocking call there is interrupted, as by Ctrl-C."""
    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)


@dataclass
class _Watched:
    process: ChildProcess
    controller: AglController | None = None
    vllm: VllmServer | None = None


class Supervisor:
    """A thread that checks every ``interval`` seconds that the watched processes still run.

    ``on_failure`` is called once, from the thread, when a vital process died (default:
    :func:`interrupt_main_thread`); :attr:`failure` holds the line saying so.
    """

    def __init__(
        self,
        *,
        max_restarts: int = DEFAULT_CONTROLLER_RESTARTS,
        max_vllm_restarts: int = DEFAULT_VLLM_RESTARTS,
        interval: float = DEFAULT_INTERVAL_SECONDS,
        on_failure: Callable[[], None] = interrupt_main_thread,
    ) -> None:
        if max_restarts < 0:
            raise ValueError(f"controller_restarts={max_restarts} must be >= 0")
        self.max_restarts = max_restarts
        self.interval = interval
        self.on_failure = on_failure
        self.restarts = 0
        self.max_vllm_restarts = max_vllm_restarts
        self.vllm_restarts = 0
        self.failure: str | None = None
        self._watched: list[_Watched] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="agl-supervisor", daemon=True)
        self._inherited_sigint: SigintHandler = None
        self._heard_ctrl_c = False

    def watch(self, process: ChildProcess) -> None:
        """Stop the run when ``process`` exits."""
        with self._lock:
            self._watched.append(_Watched(process))

    def watch_controller(self, controller: AglController) -> None:
        """Restart ``controller`` when it exits, at most :attr:`max_restarts` times in all."""
        with self._lock:
            self._watched.append(_Watched(controller.process, controller))

    def watch_vllm(self, server: VllmServer) -> None:
        """Restart ``server`` when it exits, at most :attr:`max_vllm_restarts` times over all servers."""
        with self._lock:
            self._watched.append(_Watched(server.process, vllm=server))

    def check(self) -> str | None:
        """Check every watched process now; the failure line, if a vital one died (now or before)."""
        with self._lock:
            for watched in list(self._watched):
                if self.failure is None:
                    self._check_one(watched)
            return self.failure

    def start(self) -> Supervisor:
        """Start watching. From the main thread, SIGINT is made to raise ``KeyboardInterrupt`` until
        :meth:`stop` (see :mod:`agl_trainer.interrupts`), so the default ``on_failure`` is heard."""
        if threading.current_thread() is threading.main_thread():
            self._inherited_sigint, self._heard_ctrl_c = hear_ctrl_c(), True
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._heard_ctrl_c and self._inherited_sigint is not None:
            signal.signal(signal.SIGINT, self._inherited_sigint)
        self._heard_ctrl_c = False

    def __enter__(self) -> Supervisor:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            if self.failure is None and self.check() is not None:
                self.on_failure()

    def _check_one(self, watched: _Watched) -> None:
        process = watched.process
        code = process.exit_code
        if code is None or process.stopping:
            return
        if watched.controller is not None and self.restarts < self.max_restarts:
            self.restarts += 1
            log.warning(
                "agl-controller exited with code %d; restarting it (restart %d of %d, controller_restarts=%d); "
                "its log: %s",
                code,
                self.restarts,
                self.max_restarts,
                self.max_restarts,
                process.log_path,
            )
            watched.controller.restart()
            watched.process = watched.controller.process
            return
        if watched.vllm is not None and self.vllm_restarts < self.max_vllm_restarts:
            self.vllm_restarts += 1
            log.warning(
                "vLLM server %s exited with code %d; restarting it (restart %d of %d); its log: %s",
                watched.vllm.url,
                code,
                self.vllm_restarts,
                self.max_vllm_restarts,
                process.log_path,
            )
            watched.vllm.restart()
            watched.process = watched.vllm.process
            return
        restarted = f" after {self.restarts} restarts (controller_restarts={self.max_restarts})"
        self.failure = (
            f"{process.name} exited with code {code} during the run"
            f"{restarted if watched.controller is not None else ''}; its log: {process.log_path}"
        )
        self._watched.remove(watched)


__all__ = ("DEFAULT_CONTROLLER_RESTARTS", "DEFAULT_VLLM_RESTARTS", "Supervisor", "interrupt_main_thread")
