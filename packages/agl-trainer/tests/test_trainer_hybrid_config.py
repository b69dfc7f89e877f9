"""The hybrid path's config, checked on CPU: what verl's own replicas would be started with.

Every production ``agl-trainer`` command the READMEs and docs/ show (:mod:`agl_testing.doc_commands`,
the extractor ``test_trainer_docs_commands.py`` checks every command with) is composed as
``agl-trainer`` composes it, validated, and converted by verl's own config classes, so a documented
command that would fail on its first GPU run fails here first.
"""

from __future__ import annotations

import pytest
from omegaconf import DictConfig
from verl.utils.config import omega_conf_to_dataclass

from agl_testing.doc_commands import doc_commands
from agl_trainer.assembly import compose_config, production_config
from agl_trainer.cli import parse_args
from agl_trainer.local.services import DEFAULT_MAX_RESPONSE_TOKENS, LOGPROBS_MODE
from agl_trainer.settings import parse_settings, replica_config

pytestmark = pytest.mark.verl


def doc_production_commands() -> list[tuple[str, tuple[str, ...]]]:
    """``(file:line, overrides)`` of every documented ``agl-trainer`` command that is a production run."""
    commands = [
        command for command in doc_commands("agl-trainer") if not {"-h", "--help"} & set(command.args)
    ]
    parsed = [(command.where, parse_args(command.args)) for command in commands]
    return [(where, args.overrides) for where, args in parsed if args.is_production]


COMMANDS = doc_production_commands()
HYBRID = [
    overrides for _, overrides in COMMANDS if not any("external_servers.endpoints" in o for o in overrides)
]


def test_the_readmes_show_a_hybrid_and_an_external_production_command() -> None:
    assert HYBRID, "no README production command without external_servers.endpoints (the hybrid path)"
    assert len(HYBRID) < len(COMMANDS), "no README production command with external servers"


@pytest.mark.parametrize("overrides", [o for _, o in COMMANDS], ids=[where for where, _ in COMMANDS])
def test_readme_production_command_composes_and_passes_verls_config_conversion(
    overrides: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGL_KEY", "from-the-environment")  # the deployment's key, as the docs export it
    config = production_config(overrides)
    parse_settings(config)
    section = config.actor_rollout_ref
    rollout = omega_conf_to_dataclass(section.rollout)
    actor = omega_conf_to_dataclass(section.actor)
    omega_conf_to_dataclass(section.rollout.checkpoint_engine)
    n_gpus = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    actor.validate(n_gpus, int(config.data.train_batch_size))
    assert rollout.name == "vllm"


def test_replicas_answer_to_the_gateways_model_name() -> None:
    config = compose_config(
        ["actor_rollout_ref.model.path=/models/qwen", "agentlightning.served_model_name=policy"]
    )
    served = replica_config(config).actor_rollout_ref.rollout.engine_kwargs.vllm.served_model_name
    assert served == "policy"
    assert (
        "served_model_name" not in config.actor_rollout_ref.rollout.engine_kwargs.vllm
    )  # a copy was changed


def test_replicas_answer_to_the_model_path_when_no_name_is_registered() -> None:
    config = compose_config(["actor_rollout_ref.model.path=/models/qwen"])
    assert (
        replica_config(config).actor_rollout_ref.rollout.engine_kwargs.vllm.served_model_name
        == "/models/qwen"
    )


def test_a_replica_model_name_other_than_the_gateways_is_refused_naming_both_keys() -> None:
    config = compose_config(
        [
            "agentlightning.served_model_name=policy",
            "+actor_rollout_ref.rollout.engine_kwargs.vllm.served_model_name=x",
        ]
    )
    with pytest.raises(ValueError, match=r"engine_kwargs\.vllm\.served_model_name='x'.*'policy'"):
        parse_settings(config)


def test_tensor_parallel_size_defaults_to_one_gpu_per_replica() -> None:
    config = compose_config(["trainer.n_gpus_per_node=1"])
    parse_settings(config)
    assert config.actor_rollout_ref.rollout.tensor_model_parallel_size == 1


@pytest.mark.parametrize(
    ("tp", "gpus_per_node", "nodes"),
    [(2, 1, 1), (4, 6, 1), (16, 8, 1), (3, 2, 2)],
)
def test_tensor_parallel_that_does_not_tile_the_gpus_is_refused_before_any_worker_starts(
    tp: int, gpus_per_node: int, nodes: int
) -> None:
    config = compose_config(
        [
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
            f"trainer.n_gpus_per_node={gpus_per_node}",
            f"trainer.nnodes={nodes}",
        ]
    )
    with pytest.raises(
        ValueError, match=rf"tensor_model_parallel_size={tp} .*trainer\.n_gpus_per_node={gpus_per_node}"
    ):
        parse_settings(config)


@pytest.mark.parametrize(("tp", "gpus_per_node", "nodes"), [(2, 8, 1), (8, 8, 1), (16, 8, 2)])
def test_tensor_parallel_that_tiles_the_gpus_is_accepted(tp: int, gpus_per_node: int, nodes: int) -> None:
    parse_settings(
        compose_config(
            [
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
                f"trainer.n_gpus_per_node={gpus_per_node}",
                f"trainer.nnodes={nodes}",
            ]
        )
    )


def test_replicas_and_the_cpu_vllm_server_record_the_same_log_probs_mode() -> None:
    assert compose_config().actor_rollout_ref.rollout.logprobs_mode == LOGPROBS_MODE == "processed_logprobs"


def test_replica_log_probs_mode_other_than_the_actors_is_refused() -> None:
    with pytest.raises(ValueError, match=r"logprobs_mode='raw_logprobs'.*logprobs_mode=processed_logprobs"):
        parse_settings(compose_config(["actor_rollout_ref.rollout.logprobs_mode=raw_logprobs"]))


def test_replicas_and_the_cpu_vllm_server_cap_a_call_alike() -> None:
    config: DictConfig = compose_config()
    # verl's replicas cap every call at rollout.response_length (vLLM's max_new_tokens); the CPU
    # server at its --override-generation-config, by default data.max_response_length's default.
    assert config.actor_rollout_ref.rollout.response_length == config.data.max_response_length
    assert config.data.max_response_length == DEFAULT_MAX_RESPONSE_TOKENS
