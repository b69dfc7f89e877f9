"""LoRA's keys at assembly: target modules checked against the model, the pusher each topology gets,
and a hybrid LoRA command that passes verl's own config conversion."""

from __future__ import annotations

from pathlib import Path

import pytest
from verl.utils.config import omega_conf_to_dataclass

from agl_trainer.assembly import compose_config, default_weight_pusher
from agl_trainer.local.tiny_model import build_tiny_model
from agl_trainer.serving.lora import ExternalLoraPush
from agl_trainer.serving.weights import ExternalVllmPush
from agl_trainer.settings import parse_settings, replica_config

pytestmark = pytest.mark.verl

LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]
EXTERNAL = ["agentlightning.external_servers.endpoints=[http://127.0.0.1:1/v1]"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("lora_config") / "model", seed=0)


@pytest.mark.parametrize(
    ("targets", "missing"),
    [
        ("[q_proj,qkv_proj]", "['qkv_proj']"),
        ("[attn.c_attn]", "['attn.c_attn']"),
        (r"'.*\.wq'", r"['.*\\.wq']"),
    ],
)
def test_target_modules_the_model_lacks_are_refused_naming_the_key_and_the_layers_it_has(
    model: Path, targets: str, missing: str
) -> None:
    config = compose_config(
        [
            f"actor_rollout_ref.model.path={model}",
            *LORA,
            f"actor_rollout_ref.model.target_modules={targets}",
            *EXTERNAL,
        ]
    )
    with pytest.raises(ValueError) as raised:
        parse_settings(config)
    assert str(raised.value) == (
        f"actor_rollout_ref.model.target_modules names {missing}, which the model at {model} does not have; its "
        "linear layers are ['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', "
        "'v_proj'] (or use all-linear)"
    )


@pytest.mark.parametrize(
    "targets", ["all-linear", "[q_proj,v_proj]", "[self_attn.q_proj]", r"'.*\.(q|v)_proj'"]
)
def test_target_modules_the_model_has_are_accepted(model: Path, targets: str) -> None:
    parse_settings(
        compose_config(
            [
                f"actor_rollout_ref.model.path={model}",
                *LORA,
                f"actor_rollout_ref.model.target_modules={targets}",
                *EXTERNAL,
            ]
        )
    )


def test_a_model_transformers_cannot_build_from_its_config_is_left_to_verls_own_check(tmp_path: Path) -> None:
    # A model type this transformers does not know (remote code, say): the layers cannot be listed,
    # so even a target no model has passes here; verl's workers check it when they load the model.
    (tmp_path / "config.json").write_text('{"model_type": "agl-unknown-architecture"}')
    parse_settings(
        compose_config(
            [
                f"actor_rollout_ref.model.path={tmp_path}",
                *LORA,
                "actor_rollout_ref.model.target_modules=[qkv_proj]",
                *EXTERNAL,
            ]
        )
    )


def test_external_servers_get_the_adapter_alone_with_lora_and_the_full_weights_without(
    model: Path, tmp_path: Path
) -> None:
    external = [*EXTERNAL, f"agentlightning.external_servers.weights_dir={tmp_path}"]
    with_lora = parse_settings(compose_config([f"actor_rollout_ref.model.path={model}", *LORA, *external]))
    without = parse_settings(compose_config([f"actor_rollout_ref.model.path={model}", *external]))
    assert isinstance(default_weight_pusher(with_lora.server), ExternalLoraPush)
    assert isinstance(default_weight_pusher(without.server), ExternalVllmPush)


def test_a_hybrid_lora_config_passes_verls_conversion_for_verls_own_lora_sync(model: Path) -> None:
    config = compose_config([f"actor_rollout_ref.model.path={model}", *LORA, "trainer.n_gpus_per_node=8"])
    parse_settings(config)
    section = replica_config(config).actor_rollout_ref
    converted = omega_conf_to_dataclass(section.model)
    omega_conf_to_dataclass(section.rollout)
    omega_conf_to_dataclass(section.actor).validate(8, int(config.data.train_batch_size))
    assert (converted.lora_rank, converted.lora_alpha) == (8, 16)
