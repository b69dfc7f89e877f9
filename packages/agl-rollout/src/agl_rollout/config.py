"""Configuration of the rollout managers, validated at construction."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from agl_types import RolloutConfig, RolloutK8sConfig, RolloutLocalConfig


@dataclass(frozen=True, kw_only=True)
class RolloutManagerConfig:
    """What both managers need to queue and wait for rollouts.

    ``rollout_timeout_seconds`` bounds a rollout from its enqueue time on the trainer's clock:
    past it the rollout is marked failed on the server, returned with ``timed_out=True`` and
    counted, so one stuck agent never blocks a step. It is also sent to the controller as the
    rollout's ``config.timeout_seconds``. ``progress=None`` shows a live line only on a TTY.
    ``max_poll_interval_seconds`` (None: 4x ``poll_interval_seconds``) caps how far a sync wait
    stretches its pause between sweeps while the wave is young and far from done (see
    :mod:`agl_rollout.pacing`); equal to ``poll_interval_seconds``, it sweeps at a fixed interval.
    ``include_routed_experts`` fetches each model call's MoE routes (R3 replay) with its triplets;
    off, the server leaves them out, since they run to megabytes per call.
    ``include_images`` reads each model call's image URLs from its raw event (one more GET per
    rollout) and sets them on its triplet, for vision-language training.
    ``served_adapter_prefix`` reads, from the same raw events, the LoRA adapter vLLM answered each
    call with: one named ``<prefix><N>`` makes the call's weight version ``N``, whatever the
    registration said (agl-trainer's adapter pushes switch adapters without moving it).
    ``include_endpoints`` reads, from the same raw events, the endpoint that served each call (the
    triplet view drops it) and sets it in its triplet's ``metadata["server"]["endpoint"]``, for
    per-server metrics and for telling which calls a dead server had.
    """

    train_rollout_n: int = 1
    rollout_timeout_seconds: float = 1200.0
    poll_interval_seconds: float = 1.0
    max_poll_interval_seconds: float | None = None
    local_agent_class: str | None = None
    local_env_map: Mapping[str, str] = field(default_factory=dict[str, str])
    k8s_job_template_path: str | None = None
    terminal_page_limit: int = 1000
    progress: bool | None = None
    include_routed_experts: bool = False
    include_images: bool = False
    served_adapter_prefix: str | None = None
    include_endpoints: bool = False

    def __post_init__(self) -> None:
        if self.train_rollout_n < 1:
            raise ValueError(
                f"train_rollout_n must be >= 1 (rollouts per GRPO group), got {self.train_rollout_n}"
            )
        if not (math.isfinite(self.rollout_timeout_seconds) and self.rollout_timeout_seconds > 0):
            raise ValueError(
                f"rollout_timeout_seconds must be a finite number > 0, got {self.rollout_timeout_seconds}"
            )
        if not (math.isfinite(self.poll_interval_seconds) and self.poll_interval_seconds > 0):
            raise ValueError(
                f"poll_interval_seconds must be a finite number > 0, got {self.poll_interval_seconds}"
            )
        cap = self.max_poll_interval_seconds
        if cap is not None and not (math.isfinite(cap) and cap >= self.poll_interval_seconds):
            raise ValueError(
                f"max_poll_interval_seconds must be None or a finite number >= poll_interval_seconds "
                f"({self.poll_interval_seconds}), got {cap}"
            )
        if self.terminal_page_limit < 1:
            raise ValueError(f"terminal_page_limit must be >= 1, got {self.terminal_page_limit}")
        path = self.k8s_job_template_path
        if path is not None and not Path(path).is_file():
            raise ValueError(
                f"k8s_job_template_path is {path!r}, which is not a file; give the path of the Job template"
            )

    @property
    def poll_interval_cap(self) -> float:
        """The longest pause between a sync wait's sweeps."""
        if self.max_poll_interval_seconds is None:
            return 4 * self.poll_interval_seconds
        return self.max_poll_interval_seconds

    def rollout_config(self) -> RolloutConfig:
        """The controller-facing ``config`` of every rollout this manager creates."""
        local = None
        if self.local_agent_class:
            local = RolloutLocalConfig(agent_class=self.local_agent_class, env_map=dict(self.local_env_map))
        k8s = None
        if self.k8s_job_template_path is not None:
            k8s = RolloutK8sConfig(job_template=Path(self.k8s_job_template_path).read_text())
        return RolloutConfig(timeout_seconds=math.ceil(self.rollout_timeout_seconds), local=local, k8s=k8s)


__all__ = ("RolloutManagerConfig",)
