"""verl's platform for plain CPUs (:class:`PlatformCPU`) and its selection, apart from the rest of
the CPU mode: this module imports nothing of verl but its platform registry, so the platform can be
registered before any verl module that reads the device at import time (its FSDP engine) loads,
e.g. in a process started with ``VERL_PLATFORM=cpu`` in its environment."""

import os
from collections.abc import Generator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import psutil
import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry, get_platform, set_platform

CPU_PLATFORM_NAME = "cpu"
"""Name of the platform in verl's registry and the value of ``VERL_PLATFORM`` that selects it."""


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


__all__ = ("CPU_PLATFORM_NAME", "PlatformCPU", "enable_cpu_platform")
