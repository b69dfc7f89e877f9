"""The inference servers a run pushes to, and what the trainer does when one dies or comes back.

Each server is ``live`` (registered on the gateway at the served version), ``dead`` (its
``/health`` does not answer) or ``stale`` (it answers, but a push failed on it or it came back
after a death: it may hold other weights). Only live servers are registered and pushed to.

- A watcher thread checks the live servers' ``/health`` every second; the trainer checks every
  server between steps (:meth:`Fleet.check`) and after a push failed on one. A dead server's
  registration leaves the gateway at once (agl-server picks each call's server among the
  registered ones), so new calls go to the live servers.
- A stale server that answers is caught up (the pusher's ``catch_up``: the served version, its
  probe checked) before it is registered again; it never serves old weights under the current
  version. A pusher without ``catch_up`` leaves it out.
- The run stops (:class:`NoServerLeftError`) only when no server is live, naming each and its
  last error.

A model call that failed because its server died fails its rollout; :meth:`Fleet.reruns` says
which complete groups to run again, once each (``training/n_rollouts_rerun``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

import httpx

from agl_rollout import AglClient, CarriedGroup, model_registrations
from agl_trainer.serving.errors import WeightPushError
from agl_trainer.serving.vllm_client import server_root
from agl_types import CompletedRollout, RolloutState

logger = logging.getLogger(__name__)

ServerState = Literal["live", "dead", "stale"]
HEALTH_TIMEOUT_S = 5.0
WATCH_INTERVAL_S = 1.0
RERUN_WINDOW_S = 10.0
"""A failed rollout counts as hit by a server's death detected up to this long before it was
enqueued or after it finished (the watcher's interval and the health timeout, with a margin)."""


class NoServerLeftError(RuntimeError):
    """Every inference server of the run is dead or refused its weights; the message names each."""


@dataclass
class Server:
    """One inference server: its OpenAI endpoint, its place in the configured list, its state."""

    endpoint: str
    index: int
    state: ServerState = "live"
    last_error: str = ""


def health_error(endpoint: str, timeout_s: float = HEALTH_TIMEOUT_S) -> str | None:
    """Why ``GET <server root>/health`` did not answer 200 within ``timeout_s`` (None: it did)."""
    try:
        response = httpx.get(f"{server_root(endpoint)}/health", timeout=timeout_s)
    except httpx.HTTPError as exc:
        return f"/health did not answer: {exc!r}"
    return None if response.status_code == 200 else f"/health answered {response.status_code}"


def calls_share(rollouts: Iterable[CompletedRollout], endpoints: Sequence[str]) -> dict[str, float]:
    """``serving/calls_share/<i>``: the share of the rollouts' model calls the ``i``-th of
    ``endpoints`` served, from each call's endpoint as its triplet carries it (the collector reads
    it from the raw events: ``include_endpoints``); nothing when no call carries one."""
    served = Counter(server for rollout in rollouts for server in _call_servers(rollout))
    total = sum(served.values())
    if not total:
        return {}
    return {
        f"serving/calls_share/{i}": served[_server(endpoint)] / total for i, endpoint in enumerate(endpoints)
    }


def _server(url: str) -> str:
    """The ``host:port`` of an endpoint or of a route on its server (a LoRA run registers
    ``/agl/adapters/current/v1`` on each): the server a call went to."""
    return urlsplit(url).netloc


def _call_servers(rollout: CompletedRollout) -> list[str]:
    """The server (``host:port``) of each of the rollout's calls that records its endpoint."""
    return [
        _server(e)
        for t in rollout.triplets
        if isinstance(e := t.metadata.get("server", {}).get("endpoint"), str)
    ]


class Fleet:
    """The servers of ``endpoints``, registered on ``client``'s gateway under ``model_name`` at
    the route the pusher gives (``route``); ``catch_up`` brings one server to the served version
    (None: a server that was out stays out). See the module docstring."""

    def __init__(
        self,
        client: AglClient,
        endpoints: Sequence[str],
        *,
        model_name: str,
        route: Callable[[str, int], str],
        catch_up: Callable[[str], None] | None,
        watch_interval_s: float = WATCH_INTERVAL_S,
    ) -> None:
        self.client = client
        self.servers = [Server(endpoint, index) for index, endpoint in enumerate(endpoints)]
        self.model_name = model_name
        self.route = route
        self.catch_up = catch_up
        self.version: int | None = None
        """The version the live servers are registered at (None before the first publish)."""
        self.failures = 0
        """Servers found dead or refusing a push, counted each time (``serving/server_failures``)."""
        self.deaths: list[tuple[str, float]] = []
        """(endpoint, wall time) of each death the fleet saw."""
        self._rerun: set[str] = set()
        self._lock = threading.RLock()
        self._interval = watch_interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="agl-fleet", daemon=True)

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Every configured endpoint, in order."""
        return tuple(server.endpoint for server in self.servers)

    def live(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(server.endpoint for server in self.servers if server.state == "live")

    def start(self) -> Fleet:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def register(self, version: int) -> None:
        """Register the live servers at ``version`` (and only them)."""
        with self._lock:
            self.version = version
            self._register()

    def check(self) -> None:
        """Check every server now: a live one that does not answer is taken out, a dead one that
        answers again becomes stale, a stale one that answers is caught up and registered again."""
        with self._lock:
            for server in self.servers:
                error = health_error(server.endpoint)
                if server.state == "live":
                    if error is not None:
                        self._take_out(server, "dead", error)
                elif error is not None:
                    server.state, server.last_error = "dead", error
                else:
                    server.state = "stale" if server.state == "dead" else server.state
                    self._readmit(server)

    def push_failed(self, failures: dict[str, str]) -> None:
        """Take the servers a push failed on out (dead if they no longer answer, else stale)."""
        with self._lock:
            for server in self.servers:
                if server.endpoint in failures:
                    dead = health_error(server.endpoint) is not None
                    self._take_out(server, "dead" if dead else "stale", failures[server.endpoint])

    def require_live(self) -> None:
        """Raise :class:`NoServerLeftError` naming each server and its last error when none is live."""
        with self._lock:
            if any(server.state == "live" for server in self.servers):
                return
            named = "; ".join(f"{s.endpoint} ({s.state}): {s.last_error}" for s in self.servers)
            raise NoServerLeftError(f"no inference server is left: {named}")

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return {
                "serving/servers_live": float(sum(server.state == "live" for server in self.servers)),
                "serving/server_failures": float(self.failures),
            }

    def reruns(self, group: CarriedGroup) -> bool:
        """Whether ``group`` is to run again: a member failed while a server died (its recorded
        calls, if any, on a server that died), and the group's sample has not run again before."""
        with self._lock:
            if group.data_id in self._rerun or not self.deaths:
                return False
            hit = any(self._hit_by_a_death(rollout) for rollout in group.completed)
            if hit:
                self._rerun.add(group.data_id)
            return hit

    def _hit_by_a_death(self, rollout: CompletedRollout) -> bool:
        if rollout.rollout_state is not RolloutState.FAILED:
            return False
        started = rollout.running_at or rollout.enqueue_time
        finished = rollout.finished_at or time.time()
        called = set(_call_servers(rollout))  # empty when the calls record no endpoint
        return any(
            started - RERUN_WINDOW_S <= at <= finished + RERUN_WINDOW_S
            and (not called or _server(endpoint) in called)
            for endpoint, at in self.deaths
        )

    def _watch(self) -> None:
        while not self._stop.wait(self._interval):
            for endpoint in self.live():
                error = health_error(endpoint)
                if error is None:
                    continue
                with self._lock:
                    server = next(s for s in self.servers if s.endpoint == endpoint)
                    if server.state == "live":
                        try:
                            self._take_out(server, "dead", error)
                        except Exception:  # the trainer's next check retries; the watcher goes on
                            logger.exception("could not take %s out of the gateway", endpoint)

    def _take_out(self, server: Server, state: ServerState, error: str) -> None:
        """Mark ``server`` out and register the live ones only (call with the lock held)."""
        server.state, server.last_error = state, error
        self.failures += 1
        if state == "dead":
            self.deaths.append((server.endpoint, time.time()))
        logger.warning(
            "inference server %s is %s (%s): its calls go to the %d live server(s)",
            server.endpoint,
            state,
            error,
            len(self.live()),
        )
        self._register()

    def _readmit(self, server: Server) -> None:
        """Catch a stale server up and register it again (call with the lock held)."""
        if self.catch_up is None:
            return
        try:
            self.catch_up(server.endpoint)
        except (WeightPushError, httpx.HTTPError) as exc:
            server.last_error = str(exc)
            logger.warning("inference server %s stays out: %s", server.endpoint, exc)
            return
        server.state = "live"
        logger.warning(
            "inference server %s answers the probe at weights version %s: registered again",
            server.endpoint,
            self.version,
        )
        self._register()

    def _register(self) -> None:
        if self.version is None:
            return
        live = [s.endpoint for s in self.servers if s.state == "live"]
        if not live:
            self.client.delete_models()
            return
        routes = [self.route(endpoint, self.version) for endpoint in live]
        self.client.register_models(model_registrations(self.model_name, routes, version=self.version))


__all__ = ("Fleet", "NoServerLeftError", "Server", "ServerState", "calls_share", "health_error")
