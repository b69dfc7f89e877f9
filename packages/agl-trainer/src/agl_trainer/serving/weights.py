"""Getting new weights to the inference servers after each update.

Path 2 of the trainer (external OpenAI-compatible servers it does not host): the actor's weights
are saved in Hugging Face format and each vLLM server is asked to reload them from that folder.
Path 1 (verl's own replicas) implements the same protocol in :mod:`agl_trainer.serving.replicas`.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import httpx
import torch

from agl_trainer.serving.errors import UnchangedWeightsError, WeightPushError
from agl_trainer.serving.vllm_client import VllmClient, server_root
from agl_trainer.verl_glue.workers import PolicyWorkers

_PROBE_IDS = tuple(range(1, 9))
PROBE_ATOL = 1e-3
"""How far a caught-up server's probe log-probs may be from another server's at the same version."""


class WeightPusher(Protocol):
    """Moves the actor's weights to the inference servers.

    The trainer calls :meth:`release` before a step's training computations and :meth:`push`
    after them (and once before the first step), whether or not the actor changed: both are
    no-ops when there is nothing to do. ``pauses``: a push needs the gateway paused and its calls
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


class NoWeightPush(ReplacesServedWeights):
    """For servers that need no push (e.g. a test's stand-in server)."""

    def release(self) -> None:
        return None

    def push(self, workers: PolicyWorkers, version: int) -> dict[str, float]:
        return {}


class ExternalVllmPush(ReplacesServedWeights):
    """Save HF weights to ``weights_dir/step_<version>`` and reload them on every vLLM server.

    Only the newest folder is kept: once every server has reloaded, older ones are removed. The
    servers start with ``initial_weights`` (version 0); pushing the version they serve is a no-op.
    A reload that leaves the probe's log-probs unchanged is accepted when the new folder's tensors
    equal the served folder's (an update that changed nothing, e.g. zero advantages everywhere);
    otherwise it is an error. A first push of a version other than 0 is a resumed run's: the
    servers may serve what the run that died pushed, often these very weights, so an unchanged
    probe is accepted there unchecked (``training/weight_push_unverified``); the next push checks.
    """

    def __init__(
        self, endpoints: Sequence[str], model: str, weights_dir: Path, *, initial_weights: Path | None = None
    ) -> None:
        self.endpoints = tuple(endpoints)
        self.model = model
        self.weights_dir = Path(weights_dir)
        self.served_version = 0
        self.served_weights = initial_weights
        self.served_probe: list[float] | None = None
        """The probe's log-probs at the served version, as the first server answered them after the push."""
        self._pushed = False

    def release(self) -> None:
        return None  # the servers run on their own devices

    def push(self, workers: PolicyWorkers, version: int) -> dict[str, float]:
        resumed, self._pushed = not self._pushed and version != self.served_version, True
        if version == self.served_version:
            return {"training/weight_version": float(version)}
        target = self.weights_dir / f"step_{version}"
        workers.save_hf_weights(target)
        identical: bool | None = None  # compared once, on the first server whose probe did not move
        unverified = False
        failures: dict[str, str] = {}
        served_probe: list[float] | None = None
        for endpoint in self.endpoints:
            try:
                with VllmClient(server_root(endpoint), self.model) as client:
                    # push_weights fails loudly when the served log-probs of the probe did not change.
                    probe = client.push_weights(target, _PROBE_IDS)
                served_probe = served_probe or probe
            except UnchangedWeightsError as exc:
                if resumed:  # what the servers held is unknown: a dead run's push of these weights, say
                    unverified = True
                    continue
                if identical is None:
                    identical = self.served_weights is not None and same_tensors(target, self.served_weights)
                if not identical:
                    failures[endpoint] = str(exc)
            except (httpx.HTTPError, WeightPushError) as exc:
                failures[endpoint] = f"could not push weights version {version} ({target}): {exc!r}"
        if len(failures) == len(self.endpoints):
            raise WeightPushError(_failures_line(version, failures), failures)
        for old in self.weights_dir.glob("step_*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
        self.served_probe = served_probe or (self.served_probe if identical else None)
        self.served_version, self.served_weights = version, target
        if failures:  # the others serve the new version: the caller takes the failed ones out
            raise WeightPushError(_failures_line(version, failures), failures)
        metrics = {"training/weight_version": float(version)}
        if identical:
            metrics["training/weight_push_identical"] = 1.0
        if unverified:
            metrics["training/weight_push_unverified"] = 1.0
        return metrics

    def catch_up(self, endpoint: str) -> None:
        """Bring ``endpoint``'s server (a restarted one, or one a push failed on) to the served
        version, and check its probe against another server's at that version (the trainer's own
        folder when none is left); raises :class:`WeightPushError` naming the endpoint on a mismatch."""
        try:
            with VllmClient(server_root(endpoint), self.model) as client:
                if self.served_weights is not None and self.served_version != 0:
                    client.serve_weights(self.served_weights)
                served = client.prompt_logprobs(_PROBE_IDS)
        except httpx.HTTPError as exc:
            raise WeightPushError(
                f"could not bring the vLLM server at {endpoint} to weights version "
                f"{self.served_version}: {exc!r}",
                {endpoint: repr(exc)},
            ) from exc
        reference = self.served_probe or self._reference_probe(exclude=endpoint)
        if reference is None:
            return
        worst = max(abs(a - b) for a, b in zip(served, reference, strict=True))
        if not math.isfinite(worst) or worst > PROBE_ATOL:
            message = (
                f"the vLLM server at {endpoint}, reloaded with weights version {self.served_version}, "
                f"answers the probe {worst:.3g} away from the other servers (> {PROBE_ATOL})"
            )
            raise WeightPushError(message, {endpoint: message})

    def _reference_probe(self, *, exclude: str) -> list[float] | None:
        """The probe's log-probs on the first other server that answers (None: none does)."""
        for other in self.endpoints:
            if other == exclude:
                continue
            try:
                with VllmClient(server_root(other), self.model) as client:
                    return client.prompt_logprobs(_PROBE_IDS)
            except httpx.HTTPError:
                continue
        return None


def _failures_line(version: int, failures: dict[str, str]) -> str:
    named = "; ".join(f"at {endpoint}: {error}" for endpoint, error in failures.items())
    return (
        f"weights version {version} did not reach {len(failures)} vLLM server(s): {named}; "
        "check agentlightning.external_servers.endpoints"
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


__all__ = ("ExternalVllmPush", "NoWeightPush", "ReplacesServedWeights", "WeightPusher", "same_tensors")
