"""``Settings``: the whole config mapped once, at assembly, onto one frozen object per concern.

:func:`parse_settings` reads and checks every key agl interprets, raising a ``ValueError`` that names
the key, the value and the fix; the stages then receive their own settings object and never read
the config. :func:`configure_verl` writes agl's two choices into verl's config before the workers
copy it.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

from omegaconf import DictConfig, open_dict

from agl_algos.verl import POLICY_LOSSES, rollout_summed_name
from agl_trainer.settings.adapter import AdapterSettings, parse_adapter
from agl_trainer.settings.checks import check_verl_keys
from agl_trainer.settings.correction import (
    RolloutCorrection,
    configure_actor_loss,
    training_correction,
    validate_rollout_correction,
)
from agl_trainer.settings.loop import LoopSettings, parse_loop
from agl_trainer.settings.losses import (
    AdvantageSettings,
    BatchSettings,
    NormalizationSettings,
    OverlongSettings,
    parse_advantages,
    parse_batch,
    parse_normalization,
    parse_overlong,
)
from agl_trainer.settings.pipeline import PipelineSettings, local_vllm_servers, parse_pipeline
from agl_trainer.settings.server import ServerSettings, gateway_model_name, parse_server
from agl_trainer.settings.values import optional_positive, select_or_null

BEHAVIOUR_WEIGHT_CAP_KEY = "agentlightning.fully_async.behaviour_weight_cap"


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Everything agl reads from the config, by concern, in the order a step uses it."""

    server: ServerSettings
    pipeline: PipelineSettings
    adapter: AdapterSettings
    overlong: OverlongSettings | None
    batch: BatchSettings
    correction: RolloutCorrection | None
    """What the run trains with: the section, or the default behaviour weight in fully async."""
    advantages: AdvantageSettings
    normalization: NormalizationSettings
    loop: LoopSettings


def parse_settings(config: DictConfig) -> Settings:
    """Map and check ``config`` (agl-trainer's composed Hydra config); raises ``ValueError`` naming the key."""
    from verl.trainer.ppo.utils import need_critic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # verl's trainer warns about a disabled critic itself
        use_critic = need_critic(config)
    server = parse_server(config)
    adapter = parse_adapter(config)
    pipeline = parse_pipeline(
        config, drain_timeout_s=server.drain.timeout_s, reward_fillna_value=adapter.reward_fillna_value
    )
    if pipeline.mode == "fully_async" and server.uses_verl_replicas:
        raise ValueError(
            "agentlightning.fully_async.enabled=true needs inference servers that keep serving during the "
            "update, but agentlightning.external_servers.endpoints is empty (verl's replicas sleep while the "
            "actor trains on the same GPUs); give external servers or use agentlightning.async_rollout"
        )
    check_verl_keys(
        config,
        uses_verl_replicas=server.uses_verl_replicas,
        model_name=server.model_name,
        routing_replay_key=adapter.routing_replay_key,
        lora_rank=server.lora_rank,
    )
    cap = optional_positive(BEHAVIOUR_WEIGHT_CAP_KEY, select_or_null(config, BEHAVIOUR_WEIGHT_CAP_KEY, 2.0))
    local_vllm_servers(config)  # checked here with every key; read by the embedded default
    stale_samples = pipeline.mode != "sync" and pipeline.gate.max_staleness != 0
    return Settings(
        server=server,
        pipeline=pipeline,
        adapter=adapter,
        overlong=parse_overlong(config, adapter.max_response_length),
        batch=parse_batch(config),
        correction=training_correction(validate_rollout_correction(config), cap if stale_samples else None),
        advantages=parse_advantages(config, use_critic=use_critic),
        normalization=parse_normalization(config, adapter.max_response_length),
        loop=parse_loop(config),
    )


def configure_verl(config: DictConfig, settings: Settings) -> None:
    """Point the actor's loss at verl's ``bypass_mode`` loss when bypassing with a verl loss, and at
    ``rollout_summed:<mode>`` for a verl loss under per-rollout normalisation. Idempotent; call it
    before the workers are built (they copy the actor config)."""
    configure_actor_loss(config, settings.correction)
    normalization = settings.normalization
    if normalization.enabled and normalization.loss_mode not in POLICY_LOSSES:
        with open_dict(config.actor_rollout_ref.actor.policy_loss):
            config.actor_rollout_ref.actor.policy_loss.loss_mode = rollout_summed_name(
                normalization.loss_mode
            )


def replica_config(config: DictConfig) -> DictConfig:
    """A copy of ``config`` whose vLLM replicas answer to the gateway's model name.

    The gateway rewrites each call's ``model`` to that name; without ``--served-model-name`` vLLM
    answers only to the model path it loaded, so any other name would make every call a 404. verl
    forwards ``rollout.engine_kwargs.vllm.*`` to vLLM's command line.
    """
    replicas = copy.deepcopy(config)
    with open_dict(replicas):
        replicas.actor_rollout_ref.rollout.engine_kwargs.vllm.served_model_name = gateway_model_name(config)
    return replicas


__all__ = ("BEHAVIOUR_WEIGHT_CAP_KEY", "Settings", "configure_verl", "parse_settings", "replica_config")
