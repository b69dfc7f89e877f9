"""The config mapped once onto frozen settings, one object per concern; only this folder and the
assembly read the Hydra config."""

from agl_trainer.settings.adapter import AdapterSettings
from agl_trainer.settings.config import (
    BEHAVIOUR_WEIGHT_CAP_KEY,
    Settings,
    configure_verl,
    parse_settings,
    replica_config,
)
from agl_trainer.settings.correction import ROLLOUT_CORRECTION_KEY, RolloutCorrection
from agl_trainer.settings.loop import MAX_EMPTY_STEPS_KEY, LoopSettings
from agl_trainer.settings.losses import (
    AdvantageSettings,
    BatchSettings,
    NormalizationSettings,
    OverlongSettings,
)
from agl_trainer.settings.pipeline import DynamicSamplingSettings, Mode, PipelineSettings
from agl_trainer.settings.server import ServerSettings

__all__ = (
    "BEHAVIOUR_WEIGHT_CAP_KEY",
    "MAX_EMPTY_STEPS_KEY",
    "ROLLOUT_CORRECTION_KEY",
    "AdapterSettings",
    "AdvantageSettings",
    "BatchSettings",
    "DynamicSamplingSettings",
    "LoopSettings",
    "Mode",
    "NormalizationSettings",
    "OverlongSettings",
    "PipelineSettings",
    "RolloutCorrection",
    "ServerSettings",
    "Settings",
    "configure_verl",
    "parse_settings",
    "replica_config",
)
