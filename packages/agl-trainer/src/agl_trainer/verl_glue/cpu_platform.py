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
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import psutil
import torch
import torch.distributed
from torch.distributed.fsdp import CPUOffloadPolicy
from verl.plugin.platform import PlatformBase, PlatformRegistry, get_platform, set_platform
from verl.workers.config import TrainingWorkerConfig
from verl.workers.engine_workers import TrainingWorker

from agl_trainer.verl_glue.actor_worker import AglActorRefWorker

__all__ = (
    "CPU_MODE_OVERRIDES",
    "CPU_PLATFORM_NAME",
    "CpuActorRefWorker",
    "CpuCriticWorker",
    "PlatformCPU",
    "enable_cpu_platform",
    "register_cpu_engines",
)

CPU_PLATFORM_NAME = "cpu"
"""Name of the platform in verl's registry and the value of ``VERL_PLATFORM`` that selects it."""

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


def _zero(*_args: Any, **_kwargs: Any) -> int:
    return 0


def _noop(*_args: Any, **_kwargs: Any) -> None:
    return None


def _mem_get_info(*_args: Any, **_kwargs: Any) -> tuple[int, int]:
    memory = psutil.virtual_memory()
    return memory.available, memory.total


def _build_device_module() -> ModuleType:
    """``torch.cpu`` plus the ``torch.cuda``-style calls verl makes on its device module.

    verl calls ``empty_cache``, ``mem_get_info``, ``max_memory_allocated``, ``get_rng_state`` and
    similar on ``get_torch_device()``; ``torch.cpu`` lacks them. Memory statistics read 0, RNG state
    is torch's global CPU generator.
    """
    module = ModuleType("agl_trainer_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(module, name, getattr(torch.cpu, name))
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        setattr(module, name, _zero)
    for name in ("empty_cache", "ipc_collect", "set_per_process_memory_fraction", "reset_peak_memory_stats"):
        setattr(module, name, _noop)
    extras: dict[str, Any] = {
        "mem_get_info": _mem_get_info,
        "get_rng_state": torch.get_rng_state,
        "set_rng_state": torch.set_rng_state,
        "manual_seed": torch.manual_seed,
        "manual_seed_all": torch.manual_seed,
        "get_device_name": lambda *_args: "cpu",
    }
    module.__dict__.update(extras)
    return module


_DEVICE_MODULE = _build_device_module()


class PlatformCPU(PlatformBase):
    """verl platform for plain CPUs: device ``cpu``, gloo collectives, no Ray accelerator resource.

    ``is_platform_available`` is False so verl's auto-detection never picks it; it is only used
    when selected explicitly (:func:`enable_cpu_platform` or ``VERL_PLATFORM=cpu``).
    """

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return _DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False

    def current_device(self) -> Any:
        # verl moves tensors with ``.to(get_device_id())``; an int would mean ``cuda:<int>``.
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # Ray never sets this for CPU-only actors; verl only reads it.
        return "AGL_CPU_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str) -> Generator[None]:  # pyright: ignore[reportIncompatibleMethodOverride]
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        # Worker pools are built with use_gpu=False in CPU mode; ask Ray for no accelerator anyway.
        return {}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def enable_cpu_platform() -> None:
    """Register :class:`PlatformCPU` in verl and make it the current platform (idempotent).

    Also sets ``VERL_PLATFORM=cpu`` so that processes started from this one pick it as well.
    Must run before verl modules that read the device at import time (e.g. its FSDP engine) are
    imported; the Ray worker setup hook guarantees that inside workers.
    """
    os.environ["VERL_PLATFORM"] = CPU_PLATFORM_NAME
    if PlatformRegistry.get(CPU_PLATFORM_NAME) is not PlatformCPU:
        PlatformRegistry.register(platform=CPU_PLATFORM_NAME)(PlatformCPU)
    if not isinstance(get_platform(), PlatformCPU):
        set_platform(PlatformCPU())


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
    """Start the default process group with gloo alone, from the env vars verl's worker group sets."""
    enable_cpu_platform()
    register_cpu_engines()
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend="gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
        )


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
