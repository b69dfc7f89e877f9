"""Command lines and environments of the two child servers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agl_trainer.local import ProcessStartError, agl_server_argv, start_agl_server, vllm_argv, vllm_env
from agl_trainer.local.services import VLLM_CHILD_PATH


def test_agl_server_argv_passes_hydra_overrides() -> None:
    argv = agl_server_argv(Path("/env/bin/python"), port=8123, key="k1", model_name="agl-local-policy")
    assert argv == [
        "/env/bin/python",
        "-m",
        "agentlightning.server",
        "host=127.0.0.1",
        "port=8123",
        "key=k1",
        "default_proxy.model_name=agl-local-policy",
    ]


@pytest.mark.parametrize("bad", ["a b", "x'y", "q=1", ""])
def test_agl_server_argv_refuses_values_hydra_would_misparse(bad: str) -> None:
    with pytest.raises(ValueError, match=r"model_name=.* cannot be passed as a Hydra override"):
        agl_server_argv(Path("python"), port=1, key="k", model_name=bad)


def test_vllm_argv_is_eager_float32_openai_server_through_the_child_module() -> None:
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
    ]


def test_vllm_env_enables_dev_mode_small_kv_cache_no_network_and_only_the_child_module_path() -> None:
    env = vllm_env(kv_cache_gib=2, base={"PATH": "/bin", "VIRTUAL_ENV": "/trainer/.venv", "PYTHONPATH": "/x"})
    assert env == {
        "PATH": "/bin",
        "VLLM_SERVER_DEV_MODE": "1",
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


def test_vllm_child_module_leaves_a_python_without_vllms_busy_wait_as_it_is_and_says_so() -> None:
    # The trainer's own interpreter has no vLLM: importing the child module must warn, not fail.
    probe = "import runpy; runpy.run_module('agl_vllm_server', run_name='__mp_main__'); print('imported')"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "PYTHONPATH": str(VLLM_CHILD_PATH)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (0, "imported\n")
    assert done.stderr == (
        "agl_vllm_server: vLLM's shared-memory busy-wait left as it is "
        "(ModuleNotFoundError(\"No module named 'vllm'\"))\n"
    )
