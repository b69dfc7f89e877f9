"""The polling engine both managers share: which of our rollouts finished, and finishing them.

One sweep costs a constant number of round trips whatever the number of pending rollouts:
the terminal-rollouts cursor (usually one page) says which rollouts turned terminal since
the last sweep; one listing of RUNNING and just-terminal rollouts stamps start times (until
every pending rollout has one) and brings the finished ones' statuses; on a sweep that found
none of ours finished nor listed one of ours running (and at least every 30 s), one GET of a
rotating pending rollout notices a server that lost its store
(:attr:`RolloutTracker.loss_suspected`; the managers then re-create what it lost, see
:mod:`agl_rollout.recovery`). Each finished rollout then costs a constant two calls (its triplet
events, its delete), plus one raw-event fetch when an ``on_succeeded``/``on_failed`` hook wants them.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from agl_rollout.client import AglClient
from agl_rollout.config import RolloutManagerConfig
from agl_rollout.errors import AglHTTPError, AglServerError, AglUnavailableError, RolloutsLostError
from agl_rollout.hooks import HookRunner
from agl_rollout.images import raw_calls_image_urls
from agl_rollout.lifecycle import record_lifecycle
from agl_rollout.raw_calls import (
    MODEL_REQUEST,
    raw_call_per_triplet_call,
    served_adapter_versions,
    served_endpoints,
)
from agl_rollout.triplets import TripletExtraction, build_completed_rollout, extract_triplets
from agl_types import CompletedRollout, EnqueuedRollout, Rollout, RolloutState, RolloutStatusPatch

logger = logging.getLogger("agl_rollout.wait")

_NO_EVENTS = TripletExtraction(triplets=[], final_reward=None, n_invalid_events=0)

EXISTENCE_CHECK_SECONDS = 30.0
"""A listing that shows one of ours running stands in for the existence check for this long at most,
so a rollout deleted by someone else while queued is still noticed mid-wave."""


@dataclass
class WaitCounts:
    """Outcome counts of one wait, and the queue and run times of its finished rollouts so far.

    A timed-out rollout counts as timed out, not as failed.
    """

    n_succeeded: int = 0
    n_failed: int = 0
    n_timed_out: int = 0
    n_invalid_events: int = 0
    n_recreated: int = 0
    queue_wait_s: list[float] = field(default_factory=list[float])
    run_s: list[float] = field(default_factory=list[float])

    def add(self, completed: CompletedRollout, n_invalid_events: int) -> None:
        if completed.timed_out:
            self.n_timed_out += 1
        elif completed.succeeded:
            self.n_succeeded += 1
        else:
            self.n_failed += 1
        self.n_invalid_events += n_invalid_events
        if completed.running_at is not None:
            self.queue_wait_s.append(completed.running_at - completed.enqueue_time)
            if completed.finished_at is not None:
                self.run_s.append(completed.finished_at - completed.running_at)

    @property
    def n_done(self) -> int:
        return self.n_succeeded + self.n_failed + self.n_timed_out

    def metrics(self) -> dict[str, float]:
        return {
            "training/n_rollouts_succeeded": float(self.n_succeeded),
            "training/n_rollouts_failed": float(self.n_failed),
            "training/n_rollouts_timed_out": float(self.n_timed_out),
            "training/n_invalid_events": float(self.n_invalid_events),
            "training/n_rollouts_recreated": float(self.n_recreated),
        }


class RolloutTracker:
    """Finds and finishes terminal rollouts among ``pending`` (rollout id -> its record).

    ``cursor`` is this tracker's position in the server's completion log; it must be read
    (:meth:`sync_cursor`) before the rollouts it waits for are created. ``loss_suspected`` is set
    by a sweep that saw the log shrink or a pending rollout answer 404 (a restarted server, or a
    foreign delete); the caller clears it once it has re-created what was lost.
    """

    def __init__(self, client: AglClient, config: RolloutManagerConfig, hooks: HookRunner) -> None:
        self.client = client
        self.config = config
        self.hooks = hooks
        self.cursor: int | None = None
        self.loss_suspected = False
        self._sweeps = 0
        self._last_existence_check = time.monotonic()

    def sync_cursor(self) -> None:
        if self.cursor is None:
            self.cursor = self.client.terminal_page(0, limit=1).total_terminal

    def sweep(self, pending: dict[str, EnqueuedRollout], counts: WaitCounts) -> list[CompletedRollout]:
        """One poll: finish every pending rollout that is terminal or past its timeout.

        Finished rollouts are removed from ``pending`` (O(1) each) and returned in detection order.
        """
        if not pending:
            return []
        self._sweeps += 1
        terminal_ids = self._read_terminal_log(pending)
        if self.loss_suspected:
            return []
        statuses, saw_pending = self._list_statuses(pending, terminal_ids)
        done = [self._finish_terminal(pending.pop(rid), statuses.get(rid), counts) for rid in terminal_ids]
        overdue = time.monotonic() - self._last_existence_check > EXISTENCE_CHECK_SECONDS
        if not terminal_ids and (overdue or not saw_pending):
            # Neither the log nor the listing showed one of ours (or not for a while), so nothing
            # says the server still holds them all: check one.
            self._check_one_exists(pending)
        deadline = time.time() - self.config.rollout_timeout_seconds
        for rid in [rid for rid, record in pending.items() if record.enqueue_time < deadline]:
            completed = self._time_out(pending[rid], counts)
            if completed is not None:
                del pending[rid]
                done.append(completed)
        return done

    def _read_terminal_log(self, pending: dict[str, EnqueuedRollout]) -> list[str]:
        self.sync_cursor()
        assert self.cursor is not None
        ours: list[str] = []
        while True:
            page = self.client.terminal_page(self.cursor, limit=self.config.terminal_page_limit)
            if page.total_terminal < self.cursor:
                logger.warning(
                    "agl-server's completion log shrank from %d to %d entries: it restarted",
                    self.cursor,
                    page.total_terminal,
                )
                self.loss_suspected = True
                return []
            ours.extend(item.rollout_id for item in page.items if item.rollout_id in pending)
            self.cursor = page.next_after
            if self.cursor >= page.total_terminal:
                return list(dict.fromkeys(ours))

    def _list_statuses(
        self, pending: dict[str, EnqueuedRollout], terminal_ids: list[str]
    ) -> tuple[dict[str, Rollout], bool]:
        """One listing for two jobs: stamp ``running_at`` on the pending rollouts seen RUNNING
        (skipped once all have it), and return the server's copies of the just-finished ones, and
        whether it showed a still-pending one (the server holds our rollouts).

        Finished rollouts are deleted as soon as they are processed, so the terminal part holds
        little more than this sweep's; any the listing misses (truncated) are fetched one by one,
        as is a lone finished rollout when no running stamp is needed.
        """
        finished = set(terminal_ids)
        need_running = any(r.running_at is None for rid, r in pending.items() if rid not in finished)
        states = [RolloutState.RUNNING] if need_running else []
        if len(finished) >= (1 if need_running else 2):
            states += [RolloutState.SUCCEEDED, RolloutState.FAILED]
        if not states:
            return {}, False
        statuses: dict[str, Rollout] = {}
        saw_pending = False
        for rollout in self.client.list_rollouts(
            states, limit=max(1000, 2 * len(pending) + 4 * len(finished))
        ):
            if rollout.rollout_id in finished:
                statuses[rollout.rollout_id] = rollout
            elif (record := pending.get(rollout.rollout_id)) is not None:
                record_lifecycle(record, rollout)
                saw_pending = True
        return statuses, saw_pending

    def _check_one_exists(self, pending: dict[str, EnqueuedRollout]) -> None:
        """GET one pending rollout, a different one each sweep, to notice a server that lost it."""
        if not pending:
            return
        self._last_existence_check = time.monotonic()
        rid = next(itertools.islice(pending, self._sweeps % len(pending), None))
        try:
            record_lifecycle(pending[rid], self.client.get_rollout(rid).rollout)
        except AglHTTPError as exc:
            if exc.status_code != 404:
                raise
            logger.warning("pending rollout %s is gone from agl-server: restarted or deleted", rid)
            self.loss_suspected = True

    def _finish_terminal(
        self, record: EnqueuedRollout, listed: Rollout | None, counts: WaitCounts
    ) -> CompletedRollout:
        rollout = listed or self._get_terminal(record.rollout_id)
        record_lifecycle(record, rollout)
        return self._finish(record, rollout, counts, timed_out=False)

    def _get_terminal(self, rollout_id: str) -> Rollout:
        try:
            return self.client.get_rollout(rollout_id).rollout
        except AglHTTPError as exc:
            if exc.status_code == 404:
                raise RolloutsLostError(
                    self.client.base_url, [rollout_id], "deleted right after it finished"
                ) from exc
            raise

    def _finish(
        self, record: EnqueuedRollout, rollout: Rollout, counts: WaitCounts, *, timed_out: bool
    ) -> CompletedRollout:
        """Hook, events, CompletedRollout, delete: in that order, so hook-written events count."""
        rid = record.rollout_id
        wants_raw = self.hooks.wants_events(rollout.state)
        raw = self.client.get_events(rid, include_routed_experts=False) if wants_raw else []
        self.hooks.on_finished(rollout, raw)
        events = self.client.get_events(
            rid, triplet=True, include_routed_experts=self.config.include_routed_experts
        )
        prefix = self.config.served_adapter_prefix
        paired = None  # each call's raw event, read when images, served adapters or endpoints are wanted
        if self.config.include_images or prefix is not None or self.config.include_endpoints:
            calls = self.client.get_events(rid, event_type=MODEL_REQUEST, include_routed_experts=False)
            paired = raw_call_per_triplet_call(events, calls)
        images = raw_calls_image_urls(paired) if paired is not None and self.config.include_images else None
        versions = (
            served_adapter_versions(paired, prefix) if paired is not None and prefix is not None else None
        )
        endpoints = served_endpoints(paired) if paired is not None and self.config.include_endpoints else None
        extraction = extract_triplets(events, images, versions, endpoints)
        completed = build_completed_rollout(record, rollout, extraction, timed_out=timed_out)
        self._delete(rid)
        counts.add(completed, extraction.n_invalid_events)
        return completed

    def _time_out(self, record: EnqueuedRollout, counts: WaitCounts) -> CompletedRollout | None:
        """Mark an overdue rollout failed on the server (best effort) and finish it as timed out.

        Returns ``None`` when the server says it just turned terminal on its own (409): the
        next sweep finds it in the completion log like any other.
        """
        message = f"timed out by trainer after {self.config.rollout_timeout_seconds:g} s"
        patch = RolloutStatusPatch(state=RolloutState.FAILED, error_message=message)
        try:
            rollout = self.client.patch_rollout_status(record.rollout_id, patch)
        except AglHTTPError as exc:
            if exc.status_code == 409:
                return None
            logger.warning(
                "could not mark timed-out rollout failed rollout_id=%s error=%s", record.rollout_id, exc
            )
            rollout = None
        except AglServerError as exc:
            logger.warning(
                "could not mark timed-out rollout failed rollout_id=%s error=%s", record.rollout_id, exc
            )
            rollout = None
        logger.warning(
            "rollout timed out rollout_id=%s timeout_s=%g",
            record.rollout_id,
            self.config.rollout_timeout_seconds,
        )
        if rollout is not None:
            record_lifecycle(record, rollout)
            return self._finish(record, rollout, counts, timed_out=True)
        if record.finished_at is None:
            record.finished_at = time.time()
        completed = build_completed_rollout(record, None, _NO_EVENTS, timed_out=True, error_message=message)
        self._delete(record.rollout_id)
        counts.add(completed, 0)
        return completed

    def cancel(self, record: EnqueuedRollout, reason: str) -> None:
        """Mark a pending rollout failed with ``reason`` and delete it (best effort, logged).

        Raises:
            AglUnavailableError: the server cannot be reached (nothing else will be either).
        """
        patch = RolloutStatusPatch(state=RolloutState.FAILED, error_message=reason)
        try:
            self.client.patch_rollout_status(record.rollout_id, patch)
        except AglHTTPError as exc:  # already terminal (409) or gone (404): deleting is enough
            logger.debug("cancel: status of rollout_id=%s not patched: %s", record.rollout_id, exc)
        self._delete(record.rollout_id)

    def cancel_all(self, records: Sequence[EnqueuedRollout], reason: str) -> int:
        """:meth:`cancel` each of ``records``; returns how many were cancelled. A server that cannot
        be reached ends the clean-up with one warning."""
        for n_done, record in enumerate(records):
            try:
                self.cancel(record, reason)
            except AglUnavailableError as exc:
                logger.warning("%d pending rollouts not cancelled: %s", len(records) - n_done, exc)
                return n_done
        return len(records)

    def _delete(self, rollout_id: str) -> None:
        try:
            self.client.delete_rollout(rollout_id)
        except AglServerError as exc:
            logger.warning("could not delete finished rollout rollout_id=%s error=%s", rollout_id, exc)


__all__ = ("RolloutTracker", "WaitCounts")
