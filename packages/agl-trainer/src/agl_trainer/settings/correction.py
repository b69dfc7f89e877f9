"""``algorithm.rollout_correction``: verl's off-policy correction keys, checked against verl's own
parsing, and the correction a run trains with.

An absent or null section turns the correction off. **On by default where samples are stale**: in
the async modes (fully async and carry-over) with ``max_staleness`` != 0 a sample's calls may come from weights up to K
versions behind π_prox (the recomputed old log-probs), so the PPO ratio alone would treat it as
on-policy. :func:`training_correction` then gives each token the truncated importance weight
min(π_prox / π_behaviour, cap) (decoupled PPO, as in AReaL, with verl's truncated IS:
``rollout_is: token``, ``rollout_is_threshold: cap``), unless the section already asks for IS, RS or
bypass of its own. ``agentlightning.fully_async.behaviour_weight_cap`` sets the cap (default 2.0,
verl's default threshold); null turns the default off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from verl.trainer.ppo.rollout_corr_helper import (
    SUPPORTED_ROLLOUT_RS_OPTIONS,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
)

from agl_algos import PER_ROLLOUT_MEAN_LOSS_MODE

ROLLOUT_CORRECTION_KEY = "algorithm.rollout_correction"
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")
"""``loss_type`` values of verl's ``bypass_mode`` loss (``compute_policy_loss_bypass_mode``)."""

# Losses the bypass mode can honour: verl swaps ``vanilla`` for its own ``bypass_mode`` loss (PPO
# clip against π_rollout); any other verl loss would be replaced silently, so it is refused.
_BYPASS_LOSS_MODES = (PER_ROLLOUT_MEAN_LOSS_MODE, "vanilla", "bypass_mode")


@dataclass(frozen=True, kw_only=True)
class RolloutCorrection:
    """The ``algorithm.rollout_correction`` section; field meanings and defaults as verl's yaml."""

    rollout_is: str | None = None
    rollout_is_threshold: str | float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: str | float | None = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"

    @property
    def corrects(self) -> bool:
        """Whether IS weights or rejection sampling are asked for (else metrics only, or bypass)."""
        return self.rollout_is is not None or self.rollout_rs is not None

    def as_verl_config(self) -> DictConfig:
        """The section as the config object verl's helpers read with ``.get``."""
        return OmegaConf.create(asdict(self))

    @classmethod
    def from_config(cls, config: DictConfig) -> RolloutCorrection | None:
        """Read ``config.algorithm.rollout_correction``; None when the section is absent or null.

        Raises ``ValueError`` for a key verl does not define or a value of the wrong type.
        """
        section = config.algorithm.get("rollout_correction")
        if section is None:
            return None
        if not isinstance(section, DictConfig):
            raise ValueError(
                f"{ROLLOUT_CORRECTION_KEY}={section!r}; give it as a mapping of verl's keys, or null to turn it off"
            )
        container = OmegaConf.to_container(section, resolve=True)
        assert isinstance(container, dict)
        values: dict[str, Any] = {str(key): value for key, value in container.items()}
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"{ROLLOUT_CORRECTION_KEY} has unknown keys {unknown}; the keys verl defines: {sorted(known)}"
            )
        for key in ("bypass_mode", "rollout_is_batch_normalize"):
            if key in values and not isinstance(values[key], bool):
                raise ValueError(f"{ROLLOUT_CORRECTION_KEY}.{key}={values[key]!r}; set it to true or false")
        for key in ("rollout_is", "rollout_rs", "loss_type"):
            if values.get(key) is not None and not isinstance(values[key], str):
                raise ValueError(f"{ROLLOUT_CORRECTION_KEY}.{key}={values[key]!r} must be a string or null")
        return cls(**values)


_ONE_TOKEN = (torch.zeros(1, 1), torch.ones(1, 1))
"""(log_ratio, response_mask) of a one-token batch, for dry runs of verl's parsing."""


def validate_rollout_correction(config: DictConfig) -> RolloutCorrection | None:
    """The typed section, after checking every value against verl's parsing and agl's loss.

    Raises ``ValueError`` naming the key, the value and the fix. IS and RS values are checked by
    running verl's own functions on a one-token batch, so agl accepts exactly what verl accepts.
    """
    correction = RolloutCorrection.from_config(config)
    if correction is None:
        return None
    key = ROLLOUT_CORRECTION_KEY
    if correction.loss_type not in BYPASS_LOSS_TYPES:
        raise ValueError(f"{key}.loss_type={correction.loss_type!r}; supported: {list(BYPASS_LOSS_TYPES)}")
    level, threshold = correction.rollout_is, correction.rollout_is_threshold
    if level is not None:
        _check_with_verl(
            lambda: compute_rollout_correction_weights(
                *_ONE_TOKEN, rollout_is=level, rollout_is_threshold=2.0
            ),
            f"{key}.rollout_is={level!r}",
            "set it to null, 'token' or 'sequence'",
        )
        _check_with_verl(
            lambda: compute_rollout_correction_weights(
                *_ONE_TOKEN, rollout_is="token", rollout_is_threshold=threshold
            ),
            f"{key}.rollout_is_threshold={threshold!r}",
            "give a positive upper bound (truncated IS) or a 'lower_upper' string (IcePop)",
        )
    options, rs_threshold = correction.rollout_rs, correction.rollout_rs_threshold
    if options is not None:
        _check_with_verl(
            lambda: compute_rollout_rejection_mask(
                *_ONE_TOKEN, rollout_rs=options, rollout_rs_threshold=rs_threshold
            ),
            f"{key}.rollout_rs={options!r} with rollout_rs_threshold={rs_threshold!r}",
            f"rollout_rs takes comma-separated options from {sorted(SUPPORTED_ROLLOUT_RS_OPTIONS)}; "
            "rollout_rs_threshold is required, 'lower_upper' ratio bounds for *_k1, an upper bound for k2/k3",
        )
    if correction.bypass_mode:
        _check_bypass(correction, str(config.actor_rollout_ref.actor.policy_loss.loss_mode))
    return correction


def training_correction(
    correction: RolloutCorrection | None, behaviour_weight_cap: float | None
) -> RolloutCorrection | None:
    """The correction a run trains with: ``correction`` (the validated section) when it asks for IS,
    RS or bypass, or when ``behaviour_weight_cap`` is None; otherwise token-level IS truncated at
    the cap (see the module docstring)."""
    if behaviour_weight_cap is None or (
        correction is not None and (correction.corrects or correction.bypass_mode)
    ):
        return correction
    return replace(
        correction or RolloutCorrection(), rollout_is="token", rollout_is_threshold=behaviour_weight_cap
    )


def _check_with_verl(run: Callable[[], object], setting: str, fix: str) -> None:
    try:
        run()
    except (TypeError, ValueError) as error:
        raise ValueError(f"{setting} is refused by verl ({error}); {fix}") from error


def _check_bypass(correction: RolloutCorrection, loss_mode: str) -> None:
    """Refuse bypass settings that the actor's loss would ignore."""
    key = ROLLOUT_CORRECTION_KEY
    loss_key = "actor_rollout_ref.actor.policy_loss.loss_mode"
    if loss_mode not in _BYPASS_LOSS_MODES:
        raise ValueError(
            f"{key}.bypass_mode=true replaces {loss_key}={loss_mode!r} with verl's bypass_mode loss "
            f"(PPO clip or REINFORCE against the rollout policy); set {loss_key} to one of "
            f"{list(_BYPASS_LOSS_MODES)}, or {key}.bypass_mode=false"
        )
    if loss_mode != PER_ROLLOUT_MEAN_LOSS_MODE:
        return
    # per_rollout_mean is a PPO clip loss on π_θ/π_old; with π_old = π_rollout it already is the
    # ppo_clip bypass. REINFORCE and rejection sampling need π_θ inside the loss, and IS weights
    # would count the ratio twice (verl's ppo_clip bypass computes them for metrics only).
    for name, allowed in (("loss_type", "ppo_clip"), ("rollout_rs", None), ("rollout_is", None)):
        value = getattr(correction, name)
        if value != allowed:
            raise ValueError(
                f"{key}.{name}={value!r} cannot be honoured with {key}.bypass_mode=true and "
                f"{loss_key}={PER_ROLLOUT_MEAN_LOSS_MODE!r}, which then is verl's ppo_clip bypass (its ratio "
                "pi_theta/pi_rollout is the whole correction; weights and masks against pi_theta would need "
                "it inside the loss); "
                f"set {key}.{name}={allowed or 'null'}, or {key}.bypass_mode=false to correct after the "
                f"recompute, or {loss_key}=vanilla for verl's bypass_mode loss"
            )


def configure_actor_loss(config: DictConfig, correction: RolloutCorrection | None) -> None:
    """Switch the actor to verl's ``bypass_mode`` loss when bypassing with a verl loss; else no-op.

    Call it before the workers are built: they take ``actor_rollout_ref`` at construction, so
    verl's per-step switch inside ``apply_bypass_mode`` reaches only the driver's copy. Idempotent.
    """
    policy_loss = config.actor_rollout_ref.actor.policy_loss
    if (
        correction is None
        or not correction.bypass_mode
        or policy_loss.loss_mode == PER_ROLLOUT_MEAN_LOSS_MODE
    ):
        return
    with open_dict(policy_loss):
        policy_loss.rollout_correction = correction.as_verl_config()
        policy_loss.loss_mode = "bypass_mode"


__all__ = (
    "BYPASS_LOSS_TYPES",
    "ROLLOUT_CORRECTION_KEY",
    "RolloutCorrection",
    "configure_actor_loss",
    "training_correction",
    "validate_rollout_correction",
)
