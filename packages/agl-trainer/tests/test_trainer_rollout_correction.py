"""Off-policy correction at the old-log-prob step (``agl_trainer.step.correction``), on real DataProtos.

The hand cases: one row of 3 response tokens plus one padding token, where
``old_log_probs - rollout_log_probs`` = [0.5, 1.0, -0.3], so the per-token ratios are
exp(0.5) = 1.6487, exp(1.0) = 2.7183, exp(-0.3) = 0.7408; and a second row with log-ratios
[0.2, -0.5, 0.1] (ratios 1.2214, 0.6065, 1.1052).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from verl import DataProto
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.utils.config import omega_conf_to_dataclass

from agl_trainer.assembly import compose_config
from agl_trainer.settings import RolloutCorrection, parse_settings
from agl_trainer.settings.correction import configure_actor_loss, validate_rollout_correction
from agl_trainer.step.correction import compute_old_log_probs

pytestmark = pytest.mark.verl

ROLLOUT = [[-1.5, -1.5, -1.0, 0.0], [-1.0, -1.0, -1.0, 0.0]]
OLD = [[-1.0, -0.5, -1.3, 0.0], [-0.8, -1.5, -0.9, 0.0]]  # minus ROLLOUT: [0.5, 1.0, -0.3], [0.2, -0.5, 0.1]
MASK = [[1, 1, 1, 0], [1, 1, 1, 0]]


def make_batch(*, with_rollout_log_probs: bool = True) -> DataProto:
    tensors = {"response_mask": torch.tensor(MASK)}
    if with_rollout_log_probs:
        tensors["rollout_log_probs"] = torch.tensor(ROLLOUT)
    return DataProto.from_dict(tensors=tensors)


class Recompute:
    """Stands in for ``PolicyWorkers.compute_log_prob``: returns OLD (and entropys), counts calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, batch: DataProto) -> DataProto:
        self.calls += 1
        return DataProto.from_dict(tensors={"old_log_probs": torch.tensor(OLD), "entropys": torch.ones(2, 4)})


def test_token_level_is_weights_are_the_ratios_truncated_at_the_threshold() -> None:
    batch, _metrics = compute_old_log_probs(
        make_batch(),
        RolloutCorrection(rollout_is="token", rollout_is_threshold=2.0),
        recompute=(recompute := Recompute()),
    )
    # min(ratio, 2.0) per token, 0 on padding: exp(0.5) stays, exp(1.0) = 2.718 is cut to 2.0.
    expected = [
        [math.exp(0.5), 2.0, math.exp(-0.3), 0.0],
        [math.exp(0.2), math.exp(-0.5), math.exp(0.1), 0.0],
    ]
    torch.testing.assert_close(batch.batch["rollout_is_weights"], torch.tensor(expected))
    assert batch.batch["response_mask"].tolist() == MASK
    assert recompute.calls == 1


def test_sequence_level_is_weight_is_the_product_of_ratios_truncated() -> None:
    batch, _metrics = compute_old_log_probs(
        make_batch(),
        RolloutCorrection(rollout_is="sequence", rollout_is_threshold=2.0),
        recompute=Recompute(),
    )
    # Row 1: exp(0.5 + 1.0 - 0.3) = exp(1.2) = 3.32, cut to 2.0; row 2: exp(0.2 - 0.5 + 0.1) = exp(-0.2).
    expected = [[2.0, 2.0, 2.0, 0.0], [math.exp(-0.2)] * 3 + [0.0]]
    torch.testing.assert_close(batch.batch["rollout_is_weights"], torch.tensor(expected))


def test_token_rejection_masks_the_tokens_whose_ratio_leaves_the_bounds() -> None:
    batch, metrics = compute_old_log_probs(
        make_batch(),
        RolloutCorrection(rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0"),
        recompute=Recompute(),
    )
    # Keep 0.5 <= ratio <= 2.0: only exp(1.0) = 2.718 (row 1, token 2) is rejected: 1 of 6 tokens.
    assert batch.batch["response_mask"].tolist() == [[1, 0, 1, 0], [1, 1, 1, 0]]
    assert "rollout_is_weights" not in batch.batch
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 6)


def test_sequence_rejection_masks_the_whole_row_whose_ratio_product_leaves_the_bounds() -> None:
    batch, _metrics = compute_old_log_probs(
        make_batch(),
        RolloutCorrection(rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0"),
        recompute=Recompute(),
    )
    # Row 1: exp(1.2) = 3.32 > 2.0, rejected; row 2: exp(-0.2) = 0.82, kept.
    assert batch.batch["response_mask"].tolist() == [[0, 0, 0, 0], [1, 1, 1, 0]]


def test_decoupled_mode_keeps_only_the_recomputed_old_log_probs() -> None:
    recompute = Recompute()
    batch, _metrics = compute_old_log_probs(
        make_batch(), RolloutCorrection(rollout_is="token"), recompute=recompute
    )
    assert recompute.calls == 1
    assert batch.batch["old_log_probs"].tolist() == torch.tensor(OLD).tolist()
    assert "entropys" not in batch.batch


def test_section_with_nothing_set_gives_metrics_only() -> None:
    batch, metrics = compute_old_log_probs(make_batch(), RolloutCorrection(), recompute=Recompute())
    assert "rollout_is_weights" not in batch.batch
    assert batch.batch["response_mask"].tolist() == MASK
    assert metrics and all(key.startswith("rollout_corr/") for key in metrics)


def test_metrics_only_is_skipped_without_rollout_log_probs() -> None:
    batch = make_batch(with_rollout_log_probs=False)
    batch, metrics = compute_old_log_probs(batch, RolloutCorrection(), recompute=(recompute := Recompute()))
    assert (metrics, recompute.calls) == ({}, 1)


def test_correction_off_recomputes_and_adds_nothing_else() -> None:
    recompute = Recompute()
    batch, metrics = compute_old_log_probs(make_batch(), None, recompute=recompute)
    assert recompute.calls == 1
    assert sorted(batch.batch.keys()) == ["old_log_probs", "response_mask", "rollout_log_probs"]
    assert metrics == {}


def test_bypass_with_per_rollout_mean_uses_rollout_log_probs_and_skips_the_recompute() -> None:
    recompute = Recompute()
    batch, _metrics = compute_old_log_probs(
        make_batch(), RolloutCorrection(bypass_mode=True), recompute=recompute
    )
    assert recompute.calls == 0
    assert batch.batch["old_log_probs"].tolist() == torch.tensor(ROLLOUT).tolist()
    assert "rollout_is_weights" not in batch.batch


def test_bypass_with_a_verl_loss_uses_rollout_log_probs_and_skips_the_recompute() -> None:
    recompute = Recompute()
    correction = RolloutCorrection(bypass_mode=True, loss_type="reinforce")
    batch, _metrics = compute_old_log_probs(make_batch(), correction, recompute=recompute)
    assert recompute.calls == 0
    assert batch.batch["old_log_probs"].tolist() == torch.tensor(ROLLOUT).tolist()


@pytest.mark.parametrize(
    "correction",
    [RolloutCorrection(bypass_mode=True), RolloutCorrection(rollout_is="token")],
    ids=["bypass", "decoupled-is"],
)
def test_missing_rollout_log_probs_fail_naming_the_key(correction: RolloutCorrection) -> None:
    with pytest.raises(ValueError, match="needs 'rollout_log_probs' in the batch"):
        compute_old_log_probs(
            make_batch(with_rollout_log_probs=False),
            correction,
            recompute=Recompute(),
        )


def test_configure_actor_loss_gives_the_workers_verls_bypass_loss() -> None:
    config = compose_config(
        [
            "algorithm.rollout_correction.bypass_mode=true",
            "algorithm.rollout_correction.loss_type=reinforce",
            "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
        ]
    )
    configure_actor_loss(config, validate_rollout_correction(config))
    # What the actor worker builds from its config at construction.
    seen = omega_conf_to_dataclass(config.actor_rollout_ref.actor.policy_loss)
    assert get_policy_loss_fn(seen.loss_mode).__name__ == "compute_policy_loss_bypass_mode"
    assert seen.rollout_correction["loss_type"] == "reinforce"


def test_configure_actor_loss_keeps_per_rollout_mean() -> None:
    config = compose_config(["algorithm.rollout_correction.bypass_mode=true"])
    configure_actor_loss(config, validate_rollout_correction(config))
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "per_rollout_mean"


def test_default_config_reads_as_metrics_only_and_a_null_section_as_off() -> None:
    assert validate_rollout_correction(compose_config()) == RolloutCorrection()
    assert validate_rollout_correction(compose_config(["algorithm.rollout_correction=null"])) is None


FULLY_ASYNC = [
    "agentlightning.fully_async.enabled=true",
    "agentlightning.external_servers.endpoints=[http://127.0.0.1:8000/v1]",
    "trainer.device=cpu",
]


def _trained_correction(*overrides: str) -> RolloutCorrection | None:
    """The correction the trainer trains with for ``overrides`` (as ``AglRayPPOTrainer`` builds it)."""
    return parse_settings(compose_config(list(overrides))).correction


def test_fully_async_weights_stale_tokens_by_the_truncated_behaviour_ratio_by_default() -> None:
    correction = _trained_correction(*FULLY_ASYNC)
    assert correction == RolloutCorrection(rollout_is="token", rollout_is_threshold=2.0)
    batch, _metrics = compute_old_log_probs(make_batch(), correction, recompute=Recompute())
    # The recomputed log-probs differ from the served ones: min(pi_prox / pi_behaviour, 2) per token.
    expected = [
        [math.exp(0.5), 2.0, math.exp(-0.3), 0.0],
        [math.exp(0.2), math.exp(-0.5), math.exp(0.1), 0.0],
    ]
    torch.testing.assert_close(batch.batch["rollout_is_weights"], torch.tensor(expected))


def test_the_behaviour_weight_cap_is_configurable_and_null_turns_the_default_off() -> None:
    capped = _trained_correction(*FULLY_ASYNC, "agentlightning.fully_async.behaviour_weight_cap=5")
    assert capped == RolloutCorrection(rollout_is="token", rollout_is_threshold=5.0)
    off = _trained_correction(*FULLY_ASYNC, "agentlightning.fully_async.behaviour_weight_cap=null")
    assert off == RolloutCorrection()  # verl's section as configured: metrics only


def test_no_default_behaviour_weight_where_no_sample_is_stale() -> None:
    assert _trained_correction() == RolloutCorrection()  # sync
    assert (
        _trained_correction(*FULLY_ASYNC, "agentlightning.fully_async.max_staleness=0") == RolloutCorrection()
    )


def test_a_correction_the_user_asks_for_wins_over_the_default() -> None:
    sequence = _trained_correction(*FULLY_ASYNC, "algorithm.rollout_correction.rollout_is=sequence")
    assert sequence == RolloutCorrection(rollout_is="sequence")
    bypass = _trained_correction(*FULLY_ASYNC, "algorithm.rollout_correction.bypass_mode=true")
    assert bypass == RolloutCorrection(bypass_mode=True)


def test_a_behaviour_weight_cap_that_is_not_positive_fails_naming_the_key() -> None:
    with pytest.raises(
        ValueError, match=r"agentlightning\.fully_async\.behaviour_weight_cap must be null .* got 0\.0"
    ):
        parse_settings(compose_config([*FULLY_ASYNC, "agentlightning.fully_async.behaviour_weight_cap=0"]))


@pytest.mark.parametrize(
    "overrides",
    [
        [
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=0.999_1.001",
        ],
        [
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_is_threshold=0.5_5.0",
        ],
        ["algorithm.rollout_correction.bypass_mode=true"],
        [
            "algorithm.rollout_correction.bypass_mode=true",
            "algorithm.rollout_correction.loss_type=reinforce",
            "algorithm.rollout_correction.rollout_rs=token_k3",
            "algorithm.rollout_correction.rollout_rs_threshold=0.01",
            "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
        ],
    ],
    ids=["decoupled-is-rs", "icepop", "bypass-per-rollout-mean", "bypass-reinforce-rs-verl-loss"],
)
def test_valid_settings_pass(overrides: list[str]) -> None:
    assert validate_rollout_correction(compose_config(overrides)) is not None


RC = "algorithm.rollout_correction"


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ([f"{RC}.rollout_is=tokens"], f"{RC}.rollout_is='tokens'"),
        ([f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=-1.0"], f"{RC}.rollout_is_threshold=-1.0"),
        ([f"{RC}.rollout_rs=token_k9", f"{RC}.rollout_rs_threshold=2.0"], f"{RC}.rollout_rs='token_k9'"),
        ([f"{RC}.rollout_rs=token_k1"], "rollout_rs_threshold=None"),
        ([f"{RC}.loss_type=ppo"], f"{RC}.loss_type='ppo'"),
        ([f"{RC}.bypass_mode=yes"], f"{RC}.bypass_mode='yes'"),
        ([f"+{RC}.rollout_is_treshold=3.0"], "unknown keys ['rollout_is_treshold']"),
        ([f"{RC}.bypass_mode=true", f"{RC}.loss_type=reinforce"], f"{RC}.loss_type='reinforce' cannot"),
        (
            [f"{RC}.bypass_mode=true", f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold=0.5_2.0"],
            f"{RC}.rollout_rs='token_k1' cannot",
        ),
        ([f"{RC}.bypass_mode=true", f"{RC}.rollout_is=token"], f"{RC}.rollout_is='token' cannot"),
        (
            [f"{RC}.bypass_mode=true", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"],
            "actor_rollout_ref.actor.policy_loss.loss_mode='gspo'",
        ),
    ],
)
def test_invalid_setting_fails_at_start_naming_the_key_and_value(overrides: list[str], named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        validate_rollout_correction(compose_config(overrides))
