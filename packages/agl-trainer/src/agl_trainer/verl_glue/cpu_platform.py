"""The CPU mode of agl-trainer (``trainer.device=cpu``): verl's FSDP workers on plain CPUs.

Why this module exists: verl 0.9 ships no CPU platform. Stock verl assumes an accelerator and dies
with "Distributed package doesn't have NCCL built in" on a CPU-only machine. Its FSDP engine itself
runs on CPU once these missing pieces are supplied, and this module supplies them, nothing else:

1. a ``PlatformBase`` for CPU, registered in verl's platform plugin registry
   (``verl.plugin.platform``) and made the current platform; its "current device" is
   ``torch.device("cpu")``, since verl moves tensors with ``.to(get_device_id())``;
2. verl's FSDP engine classes registered for device ``"cpu"`` in verl's engine registry (they are
   registered for ``cuda`` and ``npu`` only), with unpinned memory for forward-only modules: the
   engine gives the reference model ``CPUOffloadPolicy(pin_memory=True)``, and pinning memory
   needs an accelerator; and a value-model loader that asks for sdpa attention (verl's
   ``load_valuehead_model`` hard-codes flash-attention 2, which needs CUDA);
3. a worker class that starts the gloo process group before verl does: verl builds its backend
   string as ``"cpu:gloo,<device>:<backend>"``, which torch rejects when the device is ``cpu``;
4. the config overrides the CPU needs (:data:`CPU_MODE_OVERRIDES`).

Everything here runs both in the driver and, through :func:`agl_trainer.verl_glue.workers.setup_worker_process`
(the Ray worker setup hook), in every Ray worker. All of it is idempotent.
"""

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed
from torch.distributed.fsdp import CPUOffloadPolicy
from verl.workers.config import TrainingWorkerConfig
from verl.workers.engine_workers import TrainingWorker

from agl_trainer.verl_glue.actor_worker import AglActorRefWorker
from agl_trainer.verl_glue.cpu_device import CPU_PLATFORM_NAME, PlatformCPU, enable_cpu_platform

__all__ = (
    "CPU_MODE_OVERRIDES",
    "CPU_PLATFORM_NAME",
    "CpuActorRefWorker",
    "CpuCriticWorker",
    "PlatformCPU",
    "enable_cpu_platform",
    "register_cpu_engines",
)

_FP32 = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"

CPU_MODE_OVERRIDES: tuple[str, ...] = (
    "trainer.device=cpu",
    # FSDP1 refuses CPU parameters with sync_module_states=True; FSDP2 (fully_shard) runs on CPU.
    "actor_rollout_ref.actor.strategy=fsdp2",
    # verl's default is flash_attention_2, which needs CUDA.
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    # Remove-padding runs flash-attn varlen kernels.
    "actor_rollout_ref.model.use_remove_padding=false",
    # torch.compile on CPU needs a C++ toolchain and minutes per shape; eager is faster here.
    "actor_rollout_ref.actor.use_torch_compile=false",
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
    "actor_rollout_ref.ref.use_torch_compile=false",
    "actor_rollout_ref.ref.fsdp_config.use_torch_compile=false",
    # FSDP's default mixed precision computes in bf16; CPU training runs in fp32.
    f"+actor_rollout_ref.actor.fsdp_config.mixed_precision={_FP32}",
    f"+actor_rollout_ref.ref.fsdp_config.mixed_precision={_FP32}",
    "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
    "actor_rollout_ref.ref.fsdp_config.model_dtype=fp32",
    # The critic (GAE only) gets the same four: FSDP2, sdpa, no remove-padding, eager fp32.
    "critic.strategy=fsdp2",
    "critic.fsdp.strategy=fsdp2",
    "+critic.model.override_config.attn_implementation=sdpa",
    "critic.model.use_remove_padding=false",
    "critic.fsdp.use_torch_compile=false",
    f"+critic.fsdp.mixed_precision={_FP32}",
    "critic.fsdp.model_dtype=fp32",
)
"""Hydra overrides of verl's ``ppo_trainer`` config that the CPU mode needs, each with its reason."""


_engines_registered = False


@dataclass
class _UnpinnedCPUOffloadPolicy(CPUOffloadPolicy):
    """``CPUOffloadPolicy`` that never pins memory (pinning needs an accelerator)."""

    def __post_init__(self) -> None:
        self.pin_memory = False


def _load_value_head_model(
    local_path: str, torch_dtype: torch.dtype, model_config: Any, trust_remote_code: bool
) -> Any:
    """The critic's model: the checkpoint with a one-label token-classification head, sdpa attention."""
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(
        pretrained_model_name_or_path=local_path,
        torch_dtype=torch_dtype,
        config=model_config,
        attn_implementation="sdpa",
        trust_remote_code=trust_remote_code,
    )


def register_cpu_engines() -> None:
    """Register verl's FSDP engines (LM head and value head) for device ``cpu`` (idempotent).

    Also makes the engine module build its forward-only offload policy unpinned, and verl load
    value models with sdpa attention.
    """
    from verl.utils import model as verl_model
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    global _engines_registered
    transformer_impl.CPUOffloadPolicy = _UnpinnedCPUOffloadPolicy  # pyright: ignore[reportPrivateImportUsage]
    verl_model.load_valuehead_model = _load_value_head_model
    if _engines_registered:
        return
    for model_type, engine_cls in (
        ("language_model", FSDPEngineWithLMHead),
        ("value_model", FSDPEngineWithValueHead),
    ):
        EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device=CPU_PLATFORM_NAME)(
            engine_cls
        )
    _engines_registered = True


def _init_gloo_process_group() -> None:
    """Start the default process group with gloo alone, from the env vars verl's worker group sets.

    One rank needs no rendezvous: its store is in memory, not torch's TCP store, which listens on
    every interface (at ``MASTER_PORT``) whatever ``MASTER_ADDR`` says.
    """
    enable_cpu_platform()
    register_cpu_engines()
    if torch.distributed.is_initialized():
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # torch.distributed.HashStore is public, though its stub does not re-export it.
    store = torch.distributed.HashStore() if world_size == 1 else None  # pyright: ignore[reportPrivateImportUsage]
    torch.distributed.init_process_group(backend="gloo", store=store, rank=rank, world_size=world_size)


class CpuActorRefWorker(AglActorRefWorker):
    """verl's actor/ref worker for the CPU mode: gloo is started before verl's ``init_model``.

    Roles ``"actor"`` and ``"ref"``; ``"actor_rollout"`` only with a rollout backend that runs on
    CPU (none of verl's do; the hybrid path's tests register one in place of the GPU-bound vLLM).
    """

    def __init__(self, config: Any, role: str, **kwargs: Any) -> None:
        if role not in ("actor", "ref", "actor_rollout"):
            raise ValueError(
                f"role={role!r} is not supported in the CPU mode; use 'actor', 'ref' or 'actor_rollout'."
            )
        _init_gloo_process_group()
        super().__init__(config, role, **kwargs)


class CpuCriticWorker(TrainingWorker):
    """verl's value-model worker for the CPU mode: gloo is started before verl's own set-up."""

    def __init__(self, config: TrainingWorkerConfig) -> None:
        _init_gloo_process_group()
        super().__init__(config)
