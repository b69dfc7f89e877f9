"""Getting new weights to the inference servers after each update.

Path 2 of the trainer (external OpenAI-compatible servers it does not host): the actor's weights
are saved in Hugging Face format, uploaded to each vLLM server's own staging folder (or read from
the trainer's folder where the servers share it) while the gateway still serves, then every
server is asked at once to reload them.
Path 1 (verl's own replicas) implements the same protocol in :mod:`agl_trainer.serving.replicas`.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from agl_trainer.serving.probe import PROBE_IDS, actor_probe, check_probe, distance, served_probe, within
from agl_trainer.serving.transfer import on_each, place, push_failed
from agl_trainer.serving.vllm_client import VllmClient, server_root
from agl_trainer.verl_glue.workers import PolicyWorkers

if TYPE_CHECKING:
    from agl_trainer.settings.server import Transfer

logger = logging.getLogger(__name__)


class WeightPusher(Protocol):
    """Moves the actor's weights to the inference servers.

    The trainer calls :meth:`release` before a step's training computations, and :meth:`stage`
    then :meth:`push` after them (and once before the first step), whether or not the actor
    changed: all are no-ops when there is nothing to do. :meth:`stage` moves the bytes while the
    gateway still serves the old version; :meth:`push` (in the pause, when ``pauses``) only makes
    the servers serve them, staging first what :meth:`stage` did not. ``pauses``: a push needs the gateway paused and its calls
    drained (one that replaces the weights a call is using); :meth:`route` is the URL the gateway
    registers for an endpoint at a version. ``served_adapter_prefix``: the servers answer each call
    as the adapter ``<prefix><version>`` that served it, which records the call's version (None:
    the registration's version is the served one).
    """

    @property
    def pauses(self) -> bool: ...

    @property
    def served_adapter_prefix(self) -> str | None: ...

    def route(self, endpoint: str, version: int) -> str:
        """The OpenAI base URL the gateway sends ``version``'s calls to on ``endpoint``'s server."""
        ...

    def release(self) -> None:
        """Free what the servers hold on the training devices (verl's replicas sleep)."""
        ...

    def stage(self, workers: PolicyWorkers, version: int) -> dict[str, float]:
        """Get the actor's current weights, tagged ``version``, to the servers without serving them yet."""
        ...

    def push(self, workers: PolicyWorkers, version: int) -> dict[str, float]:
        """Make the servers serve the actor's current weights, tagged ``version``; return metrics."""
        ...


class ReplacesServedWeights:
    """What a pusher that replaces the served weights in place shares: every push pauses the
    gateway and drains its calls, and the gateway keeps routing to the endpoints as they are."""

    pauses = True
    served_adapter_prefix: str | None = None

    def route(self, endpoint: str, version: int) -> str:
        return endpoint

    def stage(self, workers: PolicyWorkers, version: int) -> dict[str, float]:
        """Nothing to move ahead of the push (the push itself moves the weights)."""
        return {}


class NoWeightPush(ReplacesServedWeights):
    """For servers that need no push (e.g. a test's stand-in server)."""

    def release(self) -> None:
        return None

    def push(self, workers: PolicyWorkers, version: int) -> dict[str, float]:
        return {}


@dataclass
class Staged:
    """A version's weights in the trainer's ``folder``, and the path each server reads them at."""

    version: int
    folder: Path
    paths: dict[str, str] = field(default_factory=dict[str, str])
    actor_logprobs: list[float] | None = None
    """The actor's probe log-probs at ``version`` (None where it could not score the probe)."""


class ExternalVllmPush(ReplacesServedWeights):
    """Save HF weights to ``weights_dir/step_<version>``, get them to every vLLM server
    (:meth:`stage`, with the gateway still serving), then reload them on all at once (:meth:`push`).

    ``transfer``: how the servers get the folder (:mod:`agl_trainer.serving.transfer`): uploaded
    into each server's own staging folder, or read from ``weights_dir`` itself (``shared_folder``).
    ``endpoints`` may be reassigned between publishes (the live servers).

    Nothing is assumed of what the servers serve at the run's start: the first publish compares
    each server's probe log-probs with the actor's own and pushes the weights when any differs by
    more than ``PROBE_ATOL`` (servers an earlier run updated, a resumed run's servers). Only the
    newest folder is kept: once a server has reloaded, older ones are removed. A reload that leaves
    the probe unchanged is accepted when the actor's own probe did not move either (an update that
    changed nothing, e.g. ``optim.lr=0``; ``training/weight_push_identical``) and, at the start, when
    the servers answered within their precision of the actor (``training/weight_push_unverified``);
    otherwise it is an error.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        model: str,
        weights_dir: Path,
        *,
        initial_weights: Path | None = None,
        transfer: Transfer = "upload",
    ) -> None:
        self.endpoints = tuple(endpoints)
        self.model = model
        self.weights_dir = Path(weights_dir)
        self.transfer: Transfer = transfer
        self.served_version: int | None = None
        """The version every live server serves; None until the first publish has checked them."""
        self.served_weights = initial_weights
        self.served_logprobs: list[float] | None = None
        """The probe's log-probs at the served version, as a server answered them."""
        self.actor_logprobs: list[float] | None = None
        """The actor's own probe log-probs at the served version."""
        self._staged: Staged | None = None
        self._checked = False

    def release(self) -> None:
        return None  # the servers run on their own devices

    def stage(self, workers: PolicyWorkers, version: int) -> dict[str, float]:
        """Save ``version``'s weights and get them to every server; nothing is reloaded yet."""
        if self._already_served(workers, version):
            return {}
        staged, failures = self._stage_on(workers, version, self.endpoints)
        if failures:
            raise push_failed(f"weights version {version} ({staged.folder})", len(self.endpoints), failures)
        return {}

    def push(self, workers: PolicyWorkers, version: int) -> dict[str, float]:
        """Reload ``version`` on every server at once (staging it first where :meth:`stage` did not)."""
        start = self.served_version is None
        if self._already_served(workers, version):
            return {"training/weight_version": float(version)}
        staged, failures = self._stage_on(workers, version, self.endpoints)
        reloaded, reload_failures = on_each(
            [endpoint for endpoint in self.endpoints if endpoint in staged.paths],
            lambda endpoint: self._reload(endpoint, staged.paths[endpoint]),
        )
        failures.update(reload_failures)
        actor = staged.actor_logprobs
        unchanged = [endpoint for endpoint, (_, moved) in reloaded.items() if not moved]
        identical = bool(unchanged) and not start and actor is not None and within(actor, self.actor_logprobs)
        if unchanged and not (start or identical):
            for endpoint in unchanged:
                del reloaded[endpoint]
                failures[endpoint] = (
                    f"served log-probs of the probe are unchanged after reloading {staged.paths[endpoint]} "
                    "though the actor's moved; the reload was ignored, or the folder holds other weights"
                )
        if reloaded:
            self._served(version, staged.folder, next(iter(reloaded.values()))[0], actor)
        if failures:
            only_unchanged = set(failures) <= set(unchanged)
            raise push_failed(
                f"weights version {version} ({staged.folder})",
                len(self.endpoints),
                failures,
                unchanged=only_unchanged,
            )
        metrics = {"training/weight_version": float(version)}
        if identical:
            metrics["training/weight_push_identical"] = 1.0
        if unchanged and start:
            metrics["training/weight_push_unverified"] = 1.0
        return metrics

    def _already_served(self, workers: PolicyWorkers, version: int) -> bool:
        """Whether every server serves ``version``; at the run's first publish, found out by comparing
        each server's probe log-probs with the actor's (when one differs, all get the weights)."""
        if not self._checked:
            actor = actor_probe(workers)
            served, unreachable = on_each(
                self.endpoints, lambda endpoint: served_probe(endpoint, self.model)
            )  # the push names those
            self._checked = True
            differing = {e: probe for e, probe in served.items() if actor is None or not within(probe, actor)}
            if actor is not None and not differing and not unreachable:  # at version 0: the run's model
                start = self.served_weights if version == 0 else None
                self._served(version, start, next(iter(served.values())), actor)
            elif actor is not None and differing:
                logger.warning(
                    "weights version %d: %s serve other weights than the actor's (probe log-probs differ "
                    "by up to %s); pushing them before the first rollout",
                    version,
                    ", ".join(differing),
                    ", ".join(f"{distance(probe, actor):.3g}" for probe in differing.values()),
                )
        return version == self.served_version

    def _served(
        self, version: int, folder: Path | None, logprobs: list[float], actor: list[float] | None
    ) -> None:
        self.served_version, self.served_weights = version, folder
        self.served_logprobs, self.actor_logprobs = logprobs, actor
        self._staged = None
        for old in self.weights_dir.glob("step_*"):
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)

    def catch_up(self, endpoint: str) -> None:
        """Bring ``endpoint``'s server (one that restarted) to the served version from the trainer's
        copy of it, and check its probe log-probs against the served version's."""
        if self.served_version is None:
            return  # nothing served yet: the run's first publish checks every server
        what = f"weights version {self.served_version}"
        if self.served_weights is not None:
            step = f"step_{self.served_version}"  # the run's start: the model's own folder, of any name
            paths, failures = place(self.transfer, [endpoint], self.model, self.served_weights, name=step)
            if not failures:
                _, failures = on_each([endpoint], lambda e: self._reload(e, paths[e]))
            if failures:
                raise push_failed(f"{what} ({self.served_weights})", 1, failures)
        check_probe(endpoint, self.model, what, self.served_logprobs)

    def _stage_on(
        self, workers: PolicyWorkers, version: int, endpoints: Sequence[str]
    ) -> tuple[Staged, dict[str, str]]:
        """Save ``version`` (once) and place it on those of ``endpoints`` that lack it; the failures."""
        staged = self._staged
        if staged is None or staged.version != version:
            folder = self.weights_dir / f"step_{version}"
            shutil.rmtree(folder, ignore_errors=True)
            workers.save_hf_weights(folder)
            staged = self._staged = Staged(version, folder, actor_logprobs=actor_probe(workers))
        missing = [endpoint for endpoint in endpoints if endpoint not in staged.paths]
        keep = [f"step_{self.served_version}"]  # a server whose reload fails still serves it
        paths, failures = place(self.transfer, missing, self.model, staged.folder, keep=keep)
        staged.paths.update(paths)
        return staged, failures

    def _reload(self, endpoint: str, path: str) -> tuple[list[float], bool]:
        """Reload ``path`` on ``endpoint``'s server: the probe's log-probs after, and whether they moved."""
        with VllmClient(server_root(endpoint), self.model) as client:
            before = client.prompt_logprobs(PROBE_IDS)
            client.serve_weights(Path(path))
            after = client.prompt_logprobs(PROBE_IDS)
        return after, after != before


__all__ = (
    "ExternalVllmPush",
    "NoWeightPush",
    "ReplacesServedWeights",
    "Staged",
    "WeightPusher",
)
