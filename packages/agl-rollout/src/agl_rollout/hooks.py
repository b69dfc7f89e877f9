"""User hooks around the rollout lifecycle, loaded from a Python file.

Hooks are synchronous and all optional. Events a hook writes go through a buffering
:class:`TraceWriter` and are posted after the hook returns, so a hook that raises halfway
writes nothing. A hook that raises is logged with its traceback and never stops training:
``on_enqueue`` then keeps the original request, the others are skipped.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from agl_rollout.client import AglClient
from agl_types import Event, EventCreate, Rollout, RolloutCreate, RolloutState

logger = logging.getLogger("agl_rollout.hooks")


class TraceWriter(Protocol):
    """Where a hook writes events back (under the attempt whose events the server shows)."""

    def add_event(self, rollout_id: str, attempt_id: str, event_type: str, data: dict[str, Any]) -> None: ...


class RolloutHooks:
    """Subclass and override any of these; the defaults do nothing.

    ``on_enqueue`` runs once per rollout (``n`` times per sample) before the rollout id is
    assigned; ``on_succeeded`` and ``on_failed`` see the rollout and its events (attempt id ->
    events) and run before the events are turned into triplets, so a ``reward`` they write
    counts. Unlike the reference, ``on_failed`` gets the events too (as the design asks).
    """

    def on_startup(self, store: Any | None = None) -> None:
        return None

    def on_enqueue(self, request: RolloutCreate) -> RolloutCreate:
        return request

    def on_succeeded(self, rollout: Rollout, events: dict[str, list[Event]], store: TraceWriter) -> None:
        return None

    def on_failed(self, rollout: Rollout, events: dict[str, list[Event]], store: TraceWriter) -> None:
        return None


@dataclass
class BufferedTraceWriter:
    """Queues events in memory; :meth:`flush` posts them in order and stops at the first failure."""

    events: list[tuple[str, str, EventCreate]] = field(default_factory=list[tuple[str, str, EventCreate]])

    def add_event(self, rollout_id: str, attempt_id: str, event_type: str, data: dict[str, Any]) -> None:
        self.events.append((rollout_id, attempt_id, EventCreate(event_type=event_type, data=dict(data))))

    def flush(self, client: AglClient) -> int:
        """Post the queued events; returns how many were posted."""
        for rollout_id, attempt_id, event in self.events:
            client.post_event(rollout_id, attempt_id, event)
        return len(self.events)


def overrides(hooks: RolloutHooks, name: str) -> bool:
    """Whether ``hooks`` overrides ``RolloutHooks.<name>`` (to skip work a default hook ignores)."""
    return getattr(type(hooks), name) is not getattr(RolloutHooks, name)


class HookRunner:
    """Runs the hooks of one manager, logging and counting (``n_errors``) the ones that raise.

    Each hook call holds ``lock``: runners that share one (the trainer's validation wait on the main
    thread and its collector's thread) never call the hooks object at the same time.
    """

    def __init__(
        self, hooks: RolloutHooks | None, client: AglClient, *, lock: threading.Lock | None = None
    ) -> None:
        self.hooks = hooks
        self.client = client
        self.n_errors = 0
        self.lock = lock or threading.Lock()

    def wants_events(self, state: RolloutState) -> bool:
        """Whether the hook for a rollout ending in ``state`` is overridden (else skip fetching events)."""
        name = "on_succeeded" if state is RolloutState.SUCCEEDED else "on_failed"
        return self.hooks is not None and overrides(self.hooks, name)

    def startup(self) -> None:
        """Run ``on_startup`` once; an exception is logged and counted, and training goes on."""
        if self.hooks is None:
            return
        try:
            with self.lock:
                self.hooks.on_startup()
        except Exception:
            self._failed("on_startup", None)

    def on_enqueue(self, request: RolloutCreate) -> RolloutCreate:
        if self.hooks is None:
            return request
        try:
            with self.lock:
                result = self.hooks.on_enqueue(request.model_copy(deep=True))
            if not isinstance(result, RolloutCreate):  # pyright: ignore[reportUnnecessaryIsInstance]
                raise TypeError(
                    f"on_enqueue must return a RolloutCreate, returned {type(result).__qualname__}"
                )
        except Exception:
            self._failed("on_enqueue", None)
            return request
        return result

    def on_finished(self, rollout: Rollout, events: list[Event]) -> None:
        """``on_succeeded`` or ``on_failed``, by the rollout's state; what it writes is flushed after it."""
        if self.hooks is None:
            return
        succeeded = rollout.state is RolloutState.SUCCEEDED
        hook = self.hooks.on_succeeded if succeeded else self.hooks.on_failed
        writer = BufferedTraceWriter()
        try:
            with self.lock:
                hook(rollout, {rollout.visible_attempt_id: events}, writer)
            writer.flush(self.client)
        except Exception:
            self._failed("on_succeeded" if succeeded else "on_failed", rollout.rollout_id)

    def _failed(self, hook: str, rollout_id: str | None) -> None:
        self.n_errors += 1
        logger.exception("rollout hook raised; training continues hook=%s rollout_id=%s", hook, rollout_id)


def load_hooks(path: str | Path) -> RolloutHooks:
    """Import the file at ``path`` and instantiate its one :class:`RolloutHooks` subclass.

    Subclasses defined in the file itself are preferred; only when there is none are
    subclasses it imports considered (so a file may subclass a shared base class).
    Zero or several candidates raise a ``ValueError`` naming them.
    """
    resolved = Path(path).resolve()
    if not resolved.is_file():
        raise FileNotFoundError(f"Hooks module not found: {resolved}")
    spec = importlib.util.spec_from_file_location("_agl_hooks", resolved)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import {resolved} as a Python module; give a .py file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = {
        obj
        for _, obj in inspect.getmembers(module, inspect.isclass)
        if issubclass(obj, RolloutHooks) and obj is not RolloutHooks
    }
    local = {cls for cls in found if cls.__module__ == module.__name__}
    candidates = sorted(local or found, key=lambda cls: cls.__qualname__)
    if not candidates:
        raise ValueError(f"No RolloutHooks subclass found in {resolved}; define exactly one")
    if len(candidates) > 1:
        names = [cls.__qualname__ for cls in candidates]
        raise ValueError(f"Multiple RolloutHooks subclasses found in {resolved}: {names}; keep exactly one")
    return candidates[0]()


__all__ = ("BufferedTraceWriter", "HookRunner", "RolloutHooks", "TraceWriter", "load_hooks")
