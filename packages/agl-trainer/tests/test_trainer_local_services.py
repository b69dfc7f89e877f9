"""Command lines and environments of the two child servers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agl_testing.vllm_child import BUSY_WAIT_DEFAULTS_PROBE, IMPORT_AS_SPAWN_DOES
from agl_trainer.local import (
    ProcessStartError,
    agl_server_argv,
    key_env,
    start_agl_server,
    vllm_argv,
    vllm_env,
)
from agl_trainer.local.services import VLLM_CHILD_PATH


def test_agl_server_argv_passes_hydra_overrides_and_reads_the_key_from_the_environment() -> None:
    argv = agl_server_argv(Path("/env/bin/python"), port=8123, model_name="agl-local-policy")
    assert argv == [
        "/env/bin/python",
        "-m",
        "agentlightning.server",
        "host=127.0.0.1",
        "port=8123",
        "key=${oc.env:AGL_KEY}",
        "default_proxy.model_name=agl-local-policy",
    ]


def test_key_env_carries_the_key_and_drops_the_trainers_virtual_env() -> None:
    env = key_env("s3cret", base={"PATH": "/bin", "VIRTUAL_ENV": "/trainer/.venv", "AGL_KEY": "old"})
    assert env == {"PATH": "/bin", "AGL_KEY": "s3cret"}


@pytest.mark.parametrize("bad", ["a b", "x'y", "q=1", ""])
def test_agl_server_argv_refuses_values_hydra_would_misparse(bad: str) -> None:
    with pytest.raises(ValueError, match=r"model_name=.* cannot be passed as a Hydra override"):
        agl_server_argv(Path("python"), port=1, model_name=bad)


def test_vllm_argv_is_eager_float32_openai_server_through_the_child_module_with_the_adapter_route() -> None:
    argv = vllm_argv(Path("/v/bin/python"), model_path=Path("/m"), port=9000, served_model_name="p")
    assert argv == [
        "/v/bin/python",
        "-m",
        "agl_vllm_server",
        "--model",
        "/m",
        "--served-model-name",
        "p",
        "--host",
        "127.0.0.1",
        "--port",
        "9000",
        "--enforce-eager",
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--logprobs-mode",
        "processed_logprobs",
        "--override-generation-config",
        '{"max_new_tokens": 512}',
        "--middleware",
        "agl_adapter_route.AdapterRoute",
    ]


@pytest.mark.parametrize(
    ("lora_rank", "max_lora_rank"), [(1, "1"), (4, "8"), (8, "8"), (12, "16"), (512, "512")]
)
def test_vllm_argv_with_lora_enables_two_adapters_per_batch_at_the_next_rank_vllm_accepts(
    lora_rank: int, max_lora_rank: str
) -> None:
    argv = vllm_argv(
        Path("/v/bin/python"), model_path=Path("/m"), port=9000, served_model_name="p", lora_rank=lora_rank
    )
    assert argv[-7:] == [
        "--enable-lora",
        "--max-lora-rank",
        max_lora_rank,
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "4",
    ]


def test_vllm_argv_refuses_a_lora_rank_above_what_vllm_accepts_naming_the_key() -> None:
    with pytest.raises(
        ValueError,
        match=r"actor_rollout_ref.model.lora_rank=513 is above vLLM's largest max_lora_rank \(512\)",
    ):
        vllm_argv(
            Path("/v/bin/python"), model_path=Path("/m"), port=9000, served_model_name="p", lora_rank=513
        )


def test_vllm_env_enables_dev_mode_runtime_lora_small_kv_cache_no_network_and_only_the_child_module_path() -> (
    None
):
    env = vllm_env(kv_cache_gib=2, base={"PATH": "/bin", "VIRTUAL_ENV": "/trainer/.venv", "PYTHONPATH": "/x"})
    assert env == {
        "PATH": "/bin",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": str(VLLM_CHILD_PATH),
    }


def test_start_agl_server_reports_a_server_that_cannot_start(tmp_path: Path) -> None:
    # The trainer's own interpreter has no agentlightning, so the child exits at once.
    with pytest.raises(
        ProcessStartError, match=r"(?s)agl-server exited with code 1 .*No module named 'agentlightning'"
    ):
        start_agl_server(Path(sys.executable), tmp_path, timeout=60)
    assert (tmp_path / "agl-server.log").is_file()


@pytest.mark.parametrize(
    ("spin_condition", "defaults", "warning"),
    [
        ("def __init__(self, is_reader, context, busy_loop_s=1): pass", "(0.05,)", ""),
        (
            "def __init__(self, is_reader, busy_loop_s=1, spin=True): pass",
            "(1, True)",
            "agl_vllm_server: vLLM's shared-memory busy-wait left as it is "
            "(SpinCondition's defaulted parameters are ['busy_loop_s', 'spin'])\n",
        ),
    ],
)
def test_vllm_child_module_lowers_only_a_lone_busy_loop_default_and_otherwise_says_so(
    tmp_path: Path, spin_condition: str, defaults: str, warning: str
) -> None:
    # A stand-in vLLM module with just the class (the real one is tested in test_trainer_local_vllm).
    _stand_in_shm_broadcast(tmp_path, f"class SpinCondition:\n    {spin_condition}\n")
    done = _run_child_module(["-c", BUSY_WAIT_DEFAULTS_PROBE], tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{defaults}\n", warning)


def test_vllm_child_module_starts_a_vllm_without_spin_condition_unchanged_and_says_so(tmp_path: Path) -> None:
    _stand_in_shm_broadcast(tmp_path, "")
    done = _run_child_module(["-c", IMPORT_AS_SPAWN_DOES], tmp_path)
    assert (done.returncode, done.stdout) == (0, "")
    assert done.stderr == (
        "agl_vllm_server: vLLM's shared-memory busy-wait left as it is (AttributeError(\"module "
        "'vllm.distributed.device_communicators.shm_broadcast' has no attribute 'SpinCondition'\"))\n"
    )


def test_vllm_child_module_reaches_the_processes_the_server_spawns(tmp_path: Path) -> None:
    # vllm-cpu's server starts its engine (and that its worker) with multiprocessing's spawn; a
    # stand-in server module does the same and the spawned child reports the default it sees.
    _stand_in_shm_broadcast(tmp_path, "class SpinCondition:\n    def __init__(self, busy_loop_s=1): pass\n")
    (tmp_path / "vllm" / "spawned.py").write_text(
        "def report():\n"
        "    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition\n"
        "    print('child', SpinCondition.__init__.__defaults__, flush=True)\n"
    )
    server = tmp_path / "vllm" / "entrypoints" / "openai" / "api_server.py"
    for package in (server.parent.parent, server.parent):
        package.mkdir(exist_ok=True)
        (package / "__init__.py").write_text("")
    server.write_text(
        "import multiprocessing\n"
        "from vllm.spawned import report\n"
        "if __name__ == '__main__':\n"
        "    process = multiprocessing.get_context('spawn').Process(target=report)\n"
        "    process.start()\n"
        "    process.join()\n"
    )
    done = _run_child_module(["-m", "agl_vllm_server"], tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (0, "child (0.05,)\n", "")


def _stand_in_shm_broadcast(root: Path, text: str) -> None:
    """``vllm.distributed.device_communicators.shm_broadcast`` under ``root`` as regular packages,
    so they win over any vLLM installed in the trainer's environment."""
    package = root
    for name in ("vllm", "distributed", "device_communicators"):
        package = package / name
        package.mkdir()
        (package / "__init__.py").write_text("")
    (package / "shm_broadcast.py").write_text(text)


def _run_child_module(args: list[str], vllm_root: Path) -> subprocess.CompletedProcess[str]:
    """This interpreter with ``args``, the child module and the stand-in vLLM under ``vllm_root`` on its path."""
    return subprocess.run(
        [sys.executable, *args],
        env={**os.environ, "PYTHONPATH": f"{VLLM_CHILD_PATH}{os.pathsep}{vllm_root}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
