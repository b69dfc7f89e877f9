"""Start-up validation of agl-trainer's config: every invalid combination names its key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agl_adapter import ZippedJsonlArtifacts
from agl_trainer.assembly import compose_config
from agl_trainer.settings import parse_settings

pytestmark = pytest.mark.verl


def test_default_config_validates_with_the_reference_defaults() -> None:
    settings = parse_settings(compose_config())
    adapter = settings.adapter
    assert (adapter.level, adapter.max_prompt_length, adapter.max_response_length) == (
        "trajectory",
        2048,
        8192,
    )
    assert (settings.pipeline.manager.rollout_timeout_seconds, adapter.reward_fillna_value) == (1800.0, 0.0)
    assert settings.pipeline.mode == "sync"


def test_the_trainers_rollout_waits_draw_no_live_line_beside_its_own_bar_and_step_lines() -> None:
    assert parse_settings(compose_config()).pipeline.manager.progress is False


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (
            ["agentlightning.async_rollout.enabled=true"],
            "agentlightning.async_rollout.async_train_batch_size",
        ),
        (
            [
                "agentlightning.async_rollout.enabled=true",
                "data.train_batch_size=4",
                "agentlightning.async_rollout.async_train_batch_size=4",
            ],
            "agentlightning.async_rollout.async_train_batch_size",
        ),
        (["algorithm.adv_estimator=remax"], "algorithm.adv_estimator=remax"),
        (["agentlightning.trace_aggregator.level=episode"], "agentlightning.trace_aggregator.level"),
        (
            ["actor_rollout_ref.actor.policy_loss.loss_mode=no_such_loss"],
            "policy_loss.loss_mode='no_such_loss'",
        ),
        (["algorithm.adv_estimator=gae"], "algorithm.enable_rollout_level_advantage"),
        (["agentlightning.max_ppo_update_times=0"], "agentlightning.max_ppo_update_times"),
        (["data.train_batch_size=0"], "data.train_batch_size must be an int >= 1, got 0"),
        (["data.max_response_length=-5"], "data.max_response_length must be an int >= 1, got -5"),
        (
            ["agentlightning.fully_async.max_staleness=-1"],
            "agentlightning.fully_async.max_staleness must be null",
        ),
        (["agentlightning.rollout_timeout_seconds=0"], "agentlightning.rollout_timeout_seconds"),
        (["agentlightning.drain_timeout_seconds=0"], "agentlightning.drain_timeout_seconds must be > 0"),
        (
            ["agentlightning.drain_poll_interval_seconds=-1"],
            "agentlightning.drain_poll_interval_seconds must be > 0",
        ),
        (["trainer.device=cpu"], "agentlightning.external_servers.endpoints"),
        (
            ["agentlightning.trajectories.max_train_records=-1"],
            "agentlightning.trajectories.max_train_records must be null or an int >= 0, got -1",
        ),
        (
            ["agentlightning.trajectories.max_train_records=all"],
            "agentlightning.trajectories.max_train_records must be null or an int >= 0, got 'all'",
        ),
        (
            ["agentlightning.max_poll_interval_seconds=0.5"],
            "agentlightning.max_poll_interval_seconds must be null or >= agentlightning.poll_interval_seconds "
            "(1.0), got 0.5",
        ),
        (
            ["+actor_rollout_ref.actor.megatron.router_replay.mode=R3"],
            "actor_rollout_ref.actor.megatron.router_replay.mode=R3 replays the inference engine's MoE routes in "
            "verl's megatron engine, but actor_rollout_ref.actor.strategy=fsdp would train without them",
        ),
    ],
)
def test_invalid_combination_fails_at_start_naming_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ValueError, match=re.escape(key)):
        parse_settings(compose_config(overrides))


_MODES = {
    "sync": [],
    "async": [
        "agentlightning.async_rollout.enabled=true",
        "agentlightning.async_rollout.async_train_batch_size=8",
    ],
    "fully_async": [
        "agentlightning.fully_async.enabled=true",
        "agentlightning.external_servers.endpoints=[http://127.0.0.1:9/v1]",
    ],
}


@pytest.mark.parametrize("mode", sorted(_MODES))
@pytest.mark.parametrize("gen_batch_size", [2, 6])
@pytest.mark.parametrize("dynamic_sampling", [False, True])
def test_a_gen_batch_size_other_than_the_train_batch_size_is_refused_in_every_mode_naming_both_keys(
    mode: str, gen_batch_size: int, dynamic_sampling: bool
) -> None:
    overrides = [
        *_MODES[mode],
        "data.train_batch_size=4",
        f"data.gen_batch_size={gen_batch_size}",
        f"algorithm.filter_groups.enable={str(dynamic_sampling).lower()}",
    ]
    message = f"data.gen_batch_size ({gen_batch_size}) must be null or equal to data.train_batch_size (4): "
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_settings(compose_config(overrides))


@pytest.mark.parametrize("mode", sorted(_MODES))
def test_a_gen_batch_size_equal_to_the_train_batch_size_generates_one_steps_groups(mode: str) -> None:
    overrides = [*_MODES[mode], "data.train_batch_size=4", "data.gen_batch_size=4"]
    assert parse_settings(compose_config(overrides)).pipeline.admission.groups_per_step == 4


def test_gae_validates_once_rollout_level_advantage_is_off() -> None:
    config = compose_config(["algorithm.adv_estimator=gae", "algorithm.enable_rollout_level_advantage=false"])
    parse_settings(config)
    assert config.critic.model.path == config.actor_rollout_ref.model.path


def test_verl_replicas_serve_exactly_when_no_external_endpoints_are_given() -> None:
    assert parse_settings(compose_config()).server.uses_verl_replicas is True
    external = ["agentlightning.external_servers.endpoints=[http://127.0.0.1:8000/v1]", "trainer.device=cpu"]
    assert parse_settings(compose_config(external)).server.uses_verl_replicas is False


def test_trajectories_are_written_under_the_checkpoint_folder_unless_their_dir_is_null() -> None:
    config = compose_config(["trainer.default_local_dir=/runs/a/checkpoints"])
    adapter = parse_settings(config).adapter.build(tokenizer=None)
    assert isinstance(adapter.artifact_sink, ZippedJsonlArtifacts)
    assert adapter.artifact_sink.folder == Path("/runs/a/checkpoints/trajectories")
    assert adapter.max_train_trajectories == 24
    off = parse_settings(compose_config(["agentlightning.trajectories.dir=null"])).adapter.build(
        tokenizer=None
    )
    assert off.artifact_sink is None


@pytest.mark.parametrize(
    ("overrides", "required"),
    [
        ([], False),
        (
            [
                "+actor_rollout_ref.actor.veomni.router_replay.mode=R2",
                "actor_rollout_ref.actor.strategy=veomni",
            ],
            False,
        ),
        (
            [
                "+actor_rollout_ref.actor.veomni.router_replay.mode=R3",
                "actor_rollout_ref.actor.strategy=veomni",
            ],
            True,
        ),
    ],
)
def test_r3_router_replay_makes_every_row_carry_moe_routes(overrides: list[str], required: bool) -> None:
    settings = parse_settings(compose_config(overrides))
    assert settings.adapter.build(tokenizer=None).require_routed_experts is required
    assert (settings.adapter.routing_replay_key is not None) is required


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_local_vllm_servers_must_be_an_int_of_at_least_one(value: str) -> None:
    config = compose_config([f"agentlightning.local.vllm_servers={value}"])
    with pytest.raises(ValueError) as raised:
        parse_settings(config)
    assert str(raised.value).startswith("agentlightning.local.vllm_servers must be an int >= 1, got ")


def test_local_vllm_servers_defaults_to_one() -> None:
    from agl_trainer.settings.pipeline import local_vllm_servers

    assert local_vllm_servers(compose_config([])) == 1
    assert local_vllm_servers(compose_config(["agentlightning.local.vllm_servers=2"])) == 2
