"""Start-up validation of the fully-async keys: each invalid combination names its key and the fix."""

from __future__ import annotations

import pytest

from agl_trainer.assembly import compose_config
from agl_trainer.local.demo import agent_slots
from agl_trainer.settings import parse_settings

pytestmark = pytest.mark.verl

EXTERNAL = "agentlightning.external_servers.endpoints=[http://127.0.0.1:9/v1]"
ON = "agentlightning.fully_async.enabled=true"


def test_fully_async_defaults_bound_staleness_at_two_and_drop() -> None:
    pipeline = parse_settings(compose_config([ON, EXTERNAL])).pipeline
    assert (pipeline.mode, pipeline.gate.max_staleness, pipeline.gate.strategy) == ("fully_async", 2, "drop")
    assert pipeline.admission.max_groups == 3 * pipeline.admission.groups_per_step


def test_a_null_bound_means_no_bound() -> None:
    assert (
        parse_settings(
            compose_config([ON, EXTERNAL, "agentlightning.fully_async.max_staleness=null"])
        ).pipeline.gate.max_staleness
        is None
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [
                "agentlightning.async_rollout.enabled=true",
                "agentlightning.async_rollout.async_train_batch_size=2048",
            ],
            "agentlightning.fully_async.enabled=true and agentlightning.async_rollout.enabled=true",
        ),
        (
            ["agentlightning.fully_async.max_staleness=-1"],
            "agentlightning.fully_async.max_staleness must be null",
        ),
        (
            ["agentlightning.fully_async.stale_strategy=wait"],
            "agentlightning.fully_async.stale_strategy='wait'",
        ),
    ],
)
def test_an_invalid_fully_async_config_names_its_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_settings(compose_config([ON, EXTERNAL, *overrides]))


def test_fully_async_without_external_servers_is_refused_naming_the_endpoints_key() -> None:
    with pytest.raises(
        ValueError,
        match=r"keep serving during the update, but agentlightning\.external_servers\.endpoints is empty",
    ):
        parse_settings(compose_config([ON, "trainer.device=cuda"]))


@pytest.mark.parametrize(
    ("overrides", "groups"),
    [
        ([], 4),
        (
            [
                "agentlightning.async_rollout.enabled=true",
                "agentlightning.async_rollout.async_train_batch_size=6",
            ],
            6,
        ),
        ([ON], 12),
        ([ON, "agentlightning.fully_async.max_staleness=0"], 4),
        ([ON, "agentlightning.fully_async.max_staleness=2"], 12),
        ([ON, "agentlightning.fully_async.max_staleness=null"], 12),
        ([ON, "agentlightning.fully_async.max_groups_in_flight=5"], 5),
    ],
)
def test_each_mode_keeps_its_groups_in_flight_and_the_demo_runs_an_agent_for_each_rollout(
    overrides: list[str], groups: int
) -> None:
    config = compose_config(
        [EXTERNAL, "data.train_batch_size=4", "actor_rollout_ref.rollout.n=3", *overrides]
    )
    assert parse_settings(config).pipeline.admission.max_groups == groups
    assert agent_slots(config) == 3 * groups


CARRY_OVER = (
    "agentlightning.async_rollout.enabled=true",
    "agentlightning.async_rollout.async_train_batch_size=6",
)


def test_carry_over_async_bounds_staleness_and_corrects_by_default_as_fully_async() -> None:
    carry_over = parse_settings(compose_config([*CARRY_OVER, "data.train_batch_size=4"]))
    fully_async = parse_settings(compose_config([ON, EXTERNAL, "data.train_batch_size=4"]))
    assert (carry_over.pipeline.gate.max_staleness, carry_over.pipeline.gate.strategy) == (2, "drop")
    assert carry_over.pipeline.gate == fully_async.pipeline.gate
    assert carry_over.correction is not None
    assert (carry_over.correction.rollout_is, carry_over.correction.rollout_is_threshold) == ("token", 2.0)
    assert carry_over.correction == fully_async.correction


def test_carry_over_async_with_max_staleness_0_trains_on_policy_groups_only_and_uncorrected() -> None:
    settings = parse_settings(
        compose_config([*CARRY_OVER, "agentlightning.fully_async.max_staleness=0", "data.train_batch_size=4"])
    )
    assert settings.correction is not None  # verl's section, logging rollout_corr/* metrics only
    assert (settings.pipeline.gate.max_staleness, settings.correction.corrects) == (0, False)
