"""Getting new weights to the inference servers after each update.

Path 2 of the trainer (external OpenAI-compatible servers it does not host): the actor's weights
are saved in Hugging Face format, uploaded to each vLLM server's own staging folder (or read from
the trainer's folder where the servers share it) while the gateway still serves, then every
server is asked at once to reload them.
Path 1 (verl's own replicas) implements the same protocol in :mod:`agl_trainer.serving.replicas`.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx
import torch

from agl_trainer.serving.transfer import Transfer, on_each, one_line, place, push_failed
from agl_trainer.serving.vllm_client import VllmClient, server_root
from agl_trainer.verl_glue.workers import PolicyWorkers

PROBE_IDS = tuple(range(1, 9))
"""The token ids whose prompt log-probs tell which weights a server serves."""


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


class ExternalVllmPush(ReplacesServedWeights):
    """Save HF weights to ``weights_dir/step_<version>``, get them to every vLLM server
    (:meth:`stage`, with the gateway still serving), then reload them on all at once (:meth:`push`).

    ``transfer``: how the servers get the folder (:mod:`agl_trainer.serving.transfer`): uploaded
    into each server's own staging folder, or read from ``weights_dir`` itself (``shared_folder``).
    ``endpoints`` may be reassigned between publishes (the live servers).

    Only the newest folder is kept: once a server has reloaded, older ones are removed. The
    servers start with ``initial_weights`` (version 0); pushing the version they serve is a no-op.
    A reload that leaves the probe's log-probs unchanged is accepted when the new folder's tensors
    equal the served folder's (an update that changed nothing, e.g. zero advantages everywhere);
    otherwise it is an error. A first push of a version other than 0 is a resumed run's: the
    servers may serve what the run that died pushed, often these very weights, so an unchanged
    probe is accepted there unchecked (``training/weight_push_unverified``); the next push checks.
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
        self.served_version = 0
        self.served_weights = initial_weights
        self.served_logprobs: list[float] | None = None
        """The probe's log-probs at the served version, as a server answered them at its push."""
        self._staged: Staged | None = None
        self._pushed = False

    def release(self) -> None:
        return None  # the servers run on their own devices

    def stage(self, workers: PolicyWorkers, version: int) -> dict[str, float]:
        """Save ``version``'s weights and get them to every server; nothing is reloaded yet."""
        if version == self.served_version:
            return {}
        staged, failures = self._stage_on(workers, version, self.endpoints)
        if failures:
            raise push_failed(f"weights version {version} ({staged.folder})", len(self.endpoints), failures)
        return {}

    def push(self, workers: PolicyWorkers, version: int) -> dict[str, float]:
        """Reload ``version`` on every server at once (staging it first where :meth:`stage` did not)."""
        resumed, self._pushed = not self._pushed and version != self.served_version, True
        if version == self.served_version:
            return {"training/weight_version": float(version)}
        staged, failures = self._stage_on(workers, version, self.endpoints)
        reloaded, reload_failures = on_each(
            [endpoint for endpoint in self.endpoints if endpoint in staged.paths],
            lambda endpoint: self._reload(endpoint, staged.paths[endpoint]),
        )
        failures.update(reload_failures)
        unchanged = [endpoint for endpoint, (_, moved) in reloaded.items() if not moved]
        identical = unverified = False
        if unchanged and resumed:  # what the servers held is unknown: a dead run's push of these weights, say
            unverified = True
        elif unchanged:
            identical = self.served_weights is not None and same_tensors(staged.folder, self.served_weights)
            if not identical:
                for endpoint in unchanged:
                    del reloaded[endpoint]
                    failures[endpoint] = (
                        f"served log-probs of the probe are unchanged after reloading {staged.paths[endpoint]}; "
                        "the folder holds the weights vLLM already had, or the reload was ignored"
                    )
        if reloaded:
            self.served_version, self.served_weights = version, staged.folder
            self.served_logprobs = next(iter(reloaded.values()))[0]
            self._staged = None
            for old in self.weights_dir.glob("step_*"):
                if old != staged.folder:
                    shutil.rmtree(old, ignore_errors=True)
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
        if unverified:
            metrics["training/weight_push_unverified"] = 1.0
        return metrics

    def catch_up(self, endpoint: str) -> None:
        """Bring ``endpoint``'s server (one that restarted) to the served version from the trainer's
        copy of it, and check its probe log-probs against the served version's."""
        reference = self.served_logprobs or self._live_logprobs(exclude=endpoint)
        what = f"weights version {self.served_version}"
        if self.served_weights is not None:
            step = f"step_{self.served_version}"  # the run's start: the model's own folder, of any name
            paths, failures = place(self.transfer, [endpoint], self.model, self.served_weights, name=step)
            if not failures:
                _, failures = on_each([endpoint], lambda e: self._reload(e, paths[e]))
            if failures:
                raise push_failed(f"{what} ({self.served_weights})", 1, failures)
        check_probe(endpoint, self.model, what, reference)

    def _stage_on(
        self, workers: PolicyWorkers, version: int, endpoints: Sequence[str]
    ) -> tuple[Staged, dict[str, str]]:
        """Save ``version`` (once) and place it on those of ``endpoints`` that lack it; the failures."""
        staged = self._staged
        if staged is None or staged.version != version:
            folder = self.weights_dir / f"step_{version}"
            shutil.rmtree(folder, ignore_errors=True)
            workers.save_hf_weights(folder)
            staged = self._staged = Staged(version, folder)
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

    def _live_logprobs(self, *, exclude: str) -> list[float] | None:
        """The probe's log-probs as the first other server that answers serves them; None if none does."""
        for endpoint in self.endpoints:
            if endpoint == exclude:
                continue
            try:
                with VllmClient(server_root(endpoint), self.model) as client:
                    return client.prompt_logprobs(PROBE_IDS)
            except httpx.HTTPError:
                continue
        return None


def check_probe(
    endpoint: str, model: str, what: str, reference: Sequence[float] | None, *, atol: float = 1e-3
) -> None:
    """Raise unless ``endpoint`` answers the probe (as ``model``) with ``reference``'s log-probs
    within ``atol``. No reference (nothing pushed yet, no other server to ask): the server reloaded
    the run's start, which is all there is to check against."""
    try:
        with VllmClient(server_root(endpoint), model) as client:
            served = client.prompt_logprobs(PROBE_IDS)
    except httpx.HTTPError as exc:
        raise push_failed(what, 1, {endpoint: one_line(exc)}) from exc
    if reference is None:
        return
    worst = max(abs(a - b) for a, b in zip(served, reference, strict=True))
    if not math.isfinite(worst) or worst > atol:
        raise push_failed(
            what,
            1,
            {endpoint: f"its probe log-probs differ from the served version's by {worst:.3g} > atol={atol}"},
        )


def same_tensors(left: Path, right: Path) -> bool:
    """Whether two Hugging Face folders hold the same tensors (names, shapes and values; dtypes
    may differ, as vLLM casts on load)."""
    from safetensors.torch import load_file

    def tensors(folder: Path) -> dict[str, torch.Tensor]:
        return {
            name: t for file in sorted(folder.glob("*.safetensors")) for name, t in load_file(file).items()
        }

    a, b = tensors(left), tensors(right)
    if not a or a.keys() != b.keys():
        return False
    return all(a[k].shape == b[k].shape and torch.equal(a[k].double(), b[k].double()) for k in a)


__all__ = (
    "PROBE_IDS",
    "ExternalVllmPush",
    "NoWeightPush",
    "ReplacesServedWeights",
    "Staged",
    "WeightPusher",
    "check_probe",
    "same_tensors",
)
