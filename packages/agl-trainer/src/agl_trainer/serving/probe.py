"""The probe: how the trainer tells which weights a server serves.

One short token sequence, each token's log-prob given its prefix: vLLM answers it as a prompt's
``prompt_logprobs``, the actor computes it through verl's log-prob path
(:meth:`~agl_trainer.verl_glue.workers.PolicyWorkers.probe_logprobs`). Two answers within
:data:`PROBE_ATOL` are of the same weights.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import httpx

from agl_trainer.serving.transfer import one_line, push_failed
from agl_trainer.serving.vllm_client import VllmClient, server_root
from agl_trainer.verl_glue.workers import PolicyWorkers

PROBE_IDS = tuple(range(1, 9))
"""The token ids whose prompt log-probs tell which weights a server serves."""
PROBE_ATOL = 1e-3
"""Probe log-probs closer than this are of the same weights (vLLM's and the actor's float32 kernels
differ by about 1e-6 on the tiny model; another precision on a server moves them more)."""

logger = logging.getLogger(__name__)


def distance(a: Sequence[float], b: Sequence[float]) -> float:
    """The largest difference between two probes' log-probs."""
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def within(a: Sequence[float], b: Sequence[float] | None) -> bool:
    """Whether two probes' log-probs are of the same weights (never, against no probe)."""
    if b is None:
        return False
    worst = distance(a, b)
    return math.isfinite(worst) and worst <= PROBE_ATOL


def served_probe(endpoint: str, model: str) -> list[float]:
    """The probe's log-probs as ``endpoint``'s server answers them for ``model`` (a name it serves)."""
    with VllmClient(server_root(endpoint), model) as client:
        return client.prompt_logprobs(PROBE_IDS)


def actor_probe(workers: PolicyWorkers) -> list[float] | None:
    """The actor's probe log-probs; None, with a warning, where it cannot score a text-only probe
    (a model whose inputs verl builds otherwise): its weights are then pushed, never assumed."""
    try:
        return workers.probe_logprobs(PROBE_IDS)
    except Exception as exc:  # any failure inside verl's workers, re-raised by Ray under its own class
        logger.warning("the actor could not score the weight probe, so it is not compared: %s", exc)
        return None


def check_probe(
    endpoint: str, model: str, what: str, reference: Sequence[float] | None, *, atol: float = PROBE_ATOL
) -> None:
    """Raise unless ``endpoint`` answers the probe (as ``model``) with ``reference``'s log-probs
    within ``atol``. No reference (nothing pushed yet): the server reloaded the run's start, which
    is all there is to check against."""
    try:
        served = served_probe(endpoint, model)
    except httpx.HTTPError as exc:
        raise push_failed(what, 1, {endpoint: one_line(exc)}) from exc
    if reference is None:
        return
    worst = distance(served, reference)
    if not math.isfinite(worst) or worst > atol:
        raise push_failed(
            what,
            1,
            {endpoint: f"its probe log-probs differ from the served version's by {worst:.3g} > atol={atol}"},
        )


__all__ = ("PROBE_ATOL", "PROBE_IDS", "actor_probe", "check_probe", "distance", "served_probe", "within")
