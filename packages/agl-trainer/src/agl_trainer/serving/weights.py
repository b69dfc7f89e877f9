"""Getting new weights to the inference servers after each update.

Path 2 of the trainer (external OpenAI-compatible servers it does not host): the actor's weights
are saved in Hugging Face format and each vLLM server is asked to reload them from that folder.
Path 1 (verl's own replicas) implements the same protocol in :mod:`agl_trainer.serving.replicas`.
"""

from __future__ import annotations

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
        for endpoint in self.endpoints:
            try:
                with VllmClient(server_root(endpoint), self.model) as client:
                    # push_weights fails loudly when the served log-probs of the probe did not change.
                    client.push_weights(target, _PROBE_IDS)
            except UnchangedWeightsError:
                if resumed:  # what the servers held is unknown: a dead run's push of these weights, say
                    unverified = True
                    continue
                if identical is None:
                    identical = self.served_weights is not None and same_tensors(target, self.served_weights)
                if not identical:
                    raise
            except httpx.HTTPError as exc:
                raise WeightPushError(
                    f"could not push weights version {version} ({target}) to the vLLM server at {endpoint}: "
                    f"{exc!r}; check agentlightning.external_servers.endpoints"
                ) from exc
        for old in self.weights_dir.glob("step_*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
        self.served_version, self.served_weights = version, target
        metrics = {"training/weight_version": float(version)}
        if identical:
            metrics["training/weight_push_identical"] = 1.0
        if unverified:
            metrics["training/weight_push_unverified"] = 1.0
        return metrics


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
