"""Gateway control for the trainer: model registration with weight versions, pause and drain."""

from __future__ import annotations

import time
from collections.abc import Iterable

from agl_rollout.client import AglClient
from agl_types import ModelRegistration


def model_registrations(model: str, endpoints: Iterable[str], *, version: int) -> list[ModelRegistration]:
    """One registration per inference server; bare ``host:port`` addresses become ``http://host:port/v1``.

    ``version`` is the weight version (training step) the servers hold; the gateway copies it
    into every ``model_request`` event, so each triplet says which policy produced it.
    """
    return [
        ModelRegistration(
            model=model,
            endpoint=address if address.startswith("http") else f"http://{address}/v1",
            version=version,
        )
        for address in endpoints
    ]


def pause_and_drain(
    client: AglClient,
    reason: str,
    *,
    poll_interval: float = 0.25,
    timeout_s: float = 600.0,
    retry_after_seconds: int = 5,
) -> dict[str, float]:
    """Pause the gateway and wait until no proxied model call is in flight.

    Agents asking for new calls meanwhile get 429 with ``Retry-After: retry_after_seconds``; the
    gateway stays paused until :meth:`AglClient.resume` (a short pause, such as a weight reload,
    wants a short retry). Raises ``TimeoutError`` when calls are still in flight after
    ``timeout_s``, so a stuck upstream never hangs the trainer.
    """
    started = time.perf_counter()
    inflight_at_pause = client.pause(reason, retry_after_seconds=retry_after_seconds).inflight
    inflight = inflight_at_pause
    while inflight > 0:
        waited = time.perf_counter() - started
        if waited >= timeout_s:
            raise TimeoutError(
                f"gateway at {client.base_url} still has {inflight} model call(s) in flight after {waited:.1f} s "
                f"(timeout_s={timeout_s}); check the inference servers, or raise the drain timeout"
            )
        time.sleep(poll_interval)
        inflight = client.proxy_state().inflight
    return {
        "training/async/proxy_inflight_at_pause": float(inflight_at_pause),
        "training/async/proxy_drain_seconds": time.perf_counter() - started,
    }


__all__ = ("model_registrations", "pause_and_drain")
