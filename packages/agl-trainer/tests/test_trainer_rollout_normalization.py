"""One rollout, one vote for every loss mode: ``algorithm.normalize_by_rollout`` at start-up and on a batch."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from agl_trainer.assembly import compose_config
from agl_trainer.settings import NormalizationSettings, configure_verl, parse_settings
from agl_trainer.step.rollout_normalization import normalize_by_rollout

pytestmark = pytest.mark.verl

_LOSS_MODE = "actor_rollout_ref.actor.policy_loss.loss_mode"


def _configured(*overrides: str) -> tuple[NormalizationSettings, str]:
    config = compose_config(list(overrides))
    settings = parse_settings(config)
    configure_verl(config, settings)
    configure_verl(config, settings)  # idempotent
    return settings.normalization, str(config.actor_rollout_ref.actor.policy_loss.loss_mode)


@pytest.mark.parametrize(
    "loss_mode", ["per_rollout_mean", "cispo_per_rollout_mean", "gspo_per_rollout", "geo_mean_per_rollout"]
)
def test_agl_losses_keep_their_mode_and_are_normalised_by_default(loss_mode: str) -> None:
    normalization, actor_mode = _configured(f"{_LOSS_MODE}={loss_mode}")
    assert (normalization.enabled, normalization.divisor, actor_mode) == (True, "rollouts", loss_mode)


@pytest.mark.parametrize("loss_mode", ["vanilla", "cispo", "clip_cov"])
def test_a_verl_token_level_loss_runs_summed_over_tokens_under_normalisation(loss_mode: str) -> None:
    normalization, actor_mode = _configured(f"{_LOSS_MODE}={loss_mode}")
    assert actor_mode == f"rollout_summed:{loss_mode}"
    assert normalization.loss_mode == loss_mode
    assert get_policy_loss_fn(actor_mode).__wrapped__ is get_policy_loss_fn(loss_mode)  # pyright: ignore[reportFunctionMemberAccess]


def test_normalisation_off_trains_a_verl_loss_per_row_as_verl_does() -> None:
    normalization, actor_mode = _configured(f"{_LOSS_MODE}=gspo", "algorithm.normalize_by_rollout=false")
    assert (normalization.enabled, actor_mode) == (False, "gspo")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.normalize_by_rollout=false"], "needs algorithm.normalize_by_rollout=true"),
        ([f"{_LOSS_MODE}=gspo"], "use gspo_per_rollout"),
        ([f"{_LOSS_MODE}=geo_mean"], "use geo_mean_per_rollout"),
        ([f"{_LOSS_MODE}=sapo"], "set algorithm.normalize_by_rollout=false"),
        (["algorithm.normalize_by_rollout=sometimes"], "algorithm.normalize_by_rollout='sometimes'"),
        (["algorithm.per_rollout_divisor=tokens"], "algorithm.per_rollout_divisor='tokens'"),
        (
            ["actor_rollout_ref.actor.loss_agg_mode=seq-max"],
            "actor_rollout_ref.actor.loss_agg_mode='seq-max'",
        ),
        (
            [f"{_LOSS_MODE}=vanilla", "algorithm.rollout_correction.bypass_mode=true"],
            "algorithm.rollout_correction.bypass_mode=true",
        ),
    ],
)
def test_a_loss_that_cannot_weigh_rollouts_equally_fails_at_start_naming_the_key(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_settings(compose_config(overrides))


def _batch(rollout_ids: list[str], tokens: list[int]) -> DataProto:
    mask = torch.zeros(len(tokens), 4, dtype=torch.int64)
    for row, n in enumerate(tokens):
        mask[row, :n] = 1
    return DataProto.from_dict(
        tensors={"advantages": torch.full((len(tokens), 4), 2.0) * mask, "response_mask": mask},
        non_tensors={"rollout_id_list": np.array(rollout_ids, dtype=object)},
    )


@pytest.mark.parametrize(("divisor", "count"), [("rollouts", 2), ("rows", 3)])
def test_apply_divides_each_row_by_its_rollouts_tokens_times_the_steps_count(
    divisor: str, count: int
) -> None:
    # rollout a spans two rows (3 + 1 tokens), b one row (2 tokens)
    batch = _batch(["a", "b", "a"], [3, 2, 1])
    settings = NormalizationSettings(enabled=True, divisor=divisor, loss_mode="per_rollout_mean")  # pyright: ignore[reportArgumentType]
    batch, metrics = normalize_by_rollout(batch, settings)
    expected = torch.tensor([2 / (4 * count)] * 3 + [0.0], dtype=torch.float32)
    torch.testing.assert_close(batch.batch["advantages"][0], expected)
    torch.testing.assert_close(batch.batch["advantages"][1, :2], torch.full((2,), 2 / (2 * count)))
    torch.testing.assert_close(batch.batch["advantages"][2, :1], torch.full((1,), 2 / (4 * count)))
    assert metrics == {"training/rows_per_rollout_mean": 1.5}
    assert "rollout_index" not in batch.batch


@pytest.mark.parametrize("loss_mode", ["gspo_per_rollout", "geo_mean_per_rollout"])
def test_apply_gives_a_per_rollout_sequence_loss_each_rows_rollout_index(loss_mode: str) -> None:
    batch = _batch(["b", "a", "b", "c"], [1, 1, 1, 1])
    batch, _ = normalize_by_rollout(
        batch, NormalizationSettings(enabled=True, divisor="rollouts", loss_mode=loss_mode)
    )
    assert batch.batch["rollout_index"].tolist() == [0, 1, 0, 2]
    assert batch.batch["rollout_index"].dtype == torch.int64


def test_apply_with_normalisation_off_leaves_advantages_and_logs_rows_per_rollout() -> None:
    batch = _batch(["a", "a"], [2, 2])
    settings = NormalizationSettings(enabled=False, divisor="rollouts", loss_mode="vanilla")
    batch, metrics = normalize_by_rollout(batch, settings)
    torch.testing.assert_close(batch.batch["advantages"], _batch(["a", "a"], [2, 2]).batch["advantages"])
    assert metrics == {"training/rows_per_rollout_mean": 2.0}


def test_dr_grpos_loss_agg_mode_divides_by_the_rollouts_and_the_max_response_length() -> None:
    normalization, _ = _configured(
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
        "agentlightning.trace_aggregator.trajectory_max_response_length=16",
    )
    assert (normalization.loss_agg_mode, normalization.loss_scale_factor) == ("seq-mean-token-sum-norm", 16.0)
    batch = _batch(["a", "b", "a"], [3, 2, 1])
    batch, _ = normalize_by_rollout(batch, normalization)
    torch.testing.assert_close(batch.batch["advantages"][1, :2], torch.full((2,), 2 / (2 * 16)))


def test_an_explicit_loss_scale_factor_wins_over_the_max_response_length() -> None:
    normalization, _ = _configured(
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
        "actor_rollout_ref.actor.loss_scale_factor=5",
    )
    assert normalization.loss_scale_factor == 5.0
