"""Pausing the gateway until no model call is in flight, as ``agentlightning.drain_*`` configures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from agl_rollout import AglClient, pause_and_drain

if TYPE_CHECKING:
    from agl_trainer.settings.server import DrainSettings


@dataclass(frozen=True)
class Drain:
    """``agentlightning.drain_timeout_seconds`` and ``drain_poll_interval_seconds``, applied."""

    timeout_s: float
    poll_interval_s: float

    @classmethod
    def from_settings(cls, settings: DrainSettings) -> Drain:
        """The drain ``settings.server.drain`` configures."""
        return cls(settings.timeout_s, settings.poll_interval_s)

    def __call__(self, client: AglClient, reason: str, *, retry_after_seconds: int = 5) -> dict[str, float]:
        """Pause the gateway and wait for its calls in flight; a timeout resumes it and names the key to raise."""
        try:
            return pause_and_drain(
                client,
                reason,
                poll_interval=self.poll_interval_s,
                timeout_s=self.timeout_s,
                retry_after_seconds=retry_after_seconds,
            )
        except TimeoutError as exc:
            client.resume()  # a run that stops here must not leave the agents locked out
            raise TimeoutError(f"{exc} (agentlightning.drain_timeout_seconds={self.timeout_s:g})") from exc


__all__ = ("Drain",)
