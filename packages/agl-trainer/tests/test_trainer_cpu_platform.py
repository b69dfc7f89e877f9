"""The CPU platform registration, the Ray worker setup hook, and the verl version check."""

import warnings

import pytest
import torch
from verl.plugin.platform import PlatformRegistry, get_platform

from agl_trainer.verl_glue import cpu_platform as platform_module
from agl_trainer.verl_glue import workers
from agl_trainer.verl_glue.compat import SUPPORTED_VERL, check_verl_version

pytestmark = pytest.mark.verl


@pytest.fixture(autouse=True)
def restore_verl_globals(monkeypatch: pytest.MonkeyPatch) -> None:
    """Undo the process-wide changes (current platform, engine offload policy) after each test."""
    from verl.plugin.platform import platform_manager
    from verl.workers.engine.fsdp import transformer_impl

    monkeypatch.setattr(platform_manager, "_current_platform", platform_manager._current_platform)
    monkeypatch.setattr(transformer_impl, "CPUOffloadPolicy", transformer_impl.CPUOffloadPolicy)


@pytest.fixture
def cpu_platform_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    platform_module.enable_cpu_platform()


def test_enable_registers_and_selects_the_cpu_platform(cpu_platform_selected: None) -> None:
    assert PlatformRegistry.get("cpu") is platform_module.PlatformCPU
    platform = get_platform()
    assert isinstance(platform, platform_module.PlatformCPU)
    assert (platform.device_name, platform.communication_backend_name(), platform.ray_resource_name()) == (
        "cpu",
        "gloo",
        "CPU",
    )


def test_enable_is_idempotent(cpu_platform_selected: None) -> None:
    first = get_platform()
    platform_module.enable_cpu_platform()
    assert get_platform() is first


def test_cpu_platform_is_never_auto_detected() -> None:
    assert platform_module.PlatformCPU().is_platform_available(use_smi_check=True) is False


def test_current_device_moves_tensors_to_cpu() -> None:
    device = platform_module.PlatformCPU().current_device()
    assert torch.ones(2).to(device).device == torch.device("cpu")


def test_device_module_answers_the_cuda_style_calls_verl_makes() -> None:
    module = platform_module.PlatformCPU().device_module
    assert module.max_memory_allocated() == 0
    free, total = module.mem_get_info()
    assert 0 < free <= total
    state = module.get_rng_state()
    first = torch.rand(3)
    module.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)
    assert module.empty_cache() is None


def test_cpu_engines_are_registered_for_both_fsdp_backends(cpu_platform_selected: None) -> None:
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    platform_module.register_cpu_engines()
    platform_module.register_cpu_engines()
    for backend in ("fsdp", "fsdp2"):
        assert EngineRegistry.get_engine_cls("language_model", backend) is FSDPEngineWithLMHead
        assert EngineRegistry.get_engine_cls("value_model", backend) is FSDPEngineWithValueHead


def test_cpu_offload_policy_of_the_engine_never_pins_memory(cpu_platform_selected: None) -> None:
    from verl.workers.engine.fsdp import transformer_impl

    platform_module.register_cpu_engines()
    assert transformer_impl.CPUOffloadPolicy(pin_memory=True).pin_memory is False


def test_cpu_worker_refuses_a_rollout_only_role() -> None:
    # actor_rollout is allowed: the hybrid path's CPU tests register a CPU rollout backend.
    with pytest.raises(ValueError, match="role='rollout'"):
        platform_module.CpuActorRefWorker(config=None, role="rollout")


def test_setup_hook_runs_every_step_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    steps = (lambda: calls.append("platform"), lambda: calls.append("algos"))
    monkeypatch.setattr(workers, "WORKER_SETUP_STEPS", steps)
    workers.setup_worker_process()
    assert calls == ["platform", "algos"]


def test_setup_hook_selects_the_cpu_platform_when_verl_platform_is_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    workers.setup_worker_process()
    assert isinstance(get_platform(), platform_module.PlatformCPU)


def test_runtime_env_names_the_hook_and_selects_cpu_only_for_cpu() -> None:
    cpu_env = workers.ray_runtime_env("cpu")
    assert cpu_env["worker_process_setup_hook"] == "agl_trainer.verl_glue.workers.setup_worker_process"
    assert cpu_env["env_vars"]["VERL_PLATFORM"] == "cpu"
    assert "VERL_PLATFORM" not in workers.ray_runtime_env("cuda")["env_vars"]


def test_cpu_overrides_compose_with_verl_config() -> None:
    config = workers.compose_verl_config(
        [*platform_module.CPU_MODE_OVERRIDES, "actor_rollout_ref.rollout.name=vllm"]
    )
    assert config.trainer.device == "cpu"
    assert config.actor_rollout_ref.actor.strategy == "fsdp2"
    assert config.actor_rollout_ref.model.override_config.attn_implementation == "sdpa"
    assert config.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype == "fp32"


def test_supported_verl_is_accepted_silently() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_verl_version("0.9.1") is True


@pytest.mark.parametrize("installed", ["0.8.0", "0.10.0"])
def test_unsupported_verl_warns_naming_installed_and_supported(installed: str) -> None:
    with pytest.warns(RuntimeWarning, match=rf"verl {installed} is installed.*verl{SUPPORTED_VERL}"):
        assert check_verl_version(installed) is False
