"""``ServerSettings``: agl-server, the gateway's model name and the inference servers behind it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from omegaconf import DictConfig

from agl_trainer.settings.values import integer, one_of, positive, select, text

LORA_RANK_KEY = "actor_rollout_ref.model.lora_rank"
TRANSFER_KEY = "agentlightning.external_servers.transfer"

Transfer = Literal["upload", "shared_folder"]
"""How external servers get each version's files (:mod:`agl_trainer.serving.transfer` does it)."""
TRANSFERS: tuple[Transfer, ...] = ("upload", "shared_folder")


@dataclass(frozen=True)
class DrainSettings:
    """``agentlightning.drain_timeout_seconds`` and ``drain_poll_interval_seconds``; the trainer
    builds its :class:`~agl_trainer.serving.drain.Drain` from them."""

    timeout_s: float
    poll_interval_s: float


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """Where agl-server is, the model name agents ask for, and the servers the gateway routes to.

    ``endpoints`` empty means verl's own vLLM replicas serve the agents (:attr:`uses_verl_replicas`).
    ``initial_weights`` is the model folder the servers start from (None for a hub name): a push of
    weights identical to it is recognised, not reported as an ignored reload. ``lora_rank`` > 0:
    the actor trains a LoRA adapter, and external servers get the adapter alone. ``transfer``: how
    external servers get each version's files (:mod:`agl_trainer.serving.transfer`).
    """

    base_url: str
    key: str | None
    model_name: str
    endpoints: tuple[str, ...]
    weights_dir: Path | None
    transfer: Transfer
    initial_weights: Path | None
    lora_rank: int
    drain: DrainSettings

    @property
    def uses_verl_replicas(self) -> bool:
        """No external endpoints: verl's hybrid-engine vLLM replicas serve the agents."""
        return not self.endpoints


def gateway_model_name(config: DictConfig) -> str:
    """The model name agents ask for and the gateway rewrites every call to:
    ``agentlightning.served_model_name``, or ``actor_rollout_ref.model.path`` when that is null."""
    return str(select(config, "agentlightning.served_model_name", config.actor_rollout_ref.model.path))


def parse_server(config: DictConfig) -> ServerSettings:
    agl = config.agentlightning
    model_path = str(config.actor_rollout_ref.model.path)
    weights_dir = text(select(config, "agentlightning.external_servers.weights_dir"))
    endpoints = select(config, "agentlightning.external_servers.endpoints", [])
    return ServerSettings(
        base_url=str(agl.agl_base_url),
        key=text(agl.agl_key),
        model_name=gateway_model_name(config),
        endpoints=tuple(str(endpoint) for endpoint in endpoints),
        weights_dir=Path(weights_dir) if weights_dir else None,
        transfer=one_of(TRANSFER_KEY, select(config, TRANSFER_KEY, "upload"), TRANSFERS),
        initial_weights=Path(model_path) if Path(model_path).is_dir() else None,
        lora_rank=integer(LORA_RANK_KEY, select(config, LORA_RANK_KEY, 0), minimum=0),
        drain=DrainSettings(
            positive(
                "agentlightning.drain_timeout_seconds",
                select(config, "agentlightning.drain_timeout_seconds", 600),
            ),
            positive(
                "agentlightning.drain_poll_interval_seconds",
                select(config, "agentlightning.drain_poll_interval_seconds", 0.25),
            ),
        ),
    )


__all__ = (
    "LORA_RANK_KEY",
    "TRANSFERS",
    "TRANSFER_KEY",
    "DrainSettings",
    "ServerSettings",
    "Transfer",
    "gateway_model_name",
    "parse_server",
)
