"""A check of verl's own that fails inside a Ray worker is one line naming the keys it reads, as
agl's own checks are: verl's real check, run in a real Ray worker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agl_trainer.assembly import compose_config
from agl_trainer.local.tiny_model import build_tiny_model
from agl_trainer.settings.values import leaf_keys
from agl_trainer.verl_glue.worker_errors import verl_check_line

pytestmark = [pytest.mark.verl]

MICRO_BATCH_LINE = (
    "agl-trainer: verl refused the configuration in a Ray worker (verl/workers/config/actor.py:207): "
    "[actor] Please set at least one of 'actor.ppo_micro_batch_size' or 'actor.ppo_micro_batch_size_per_gpu' "
    "if use_dynamic_bsz is not enabled.; keys: actor_rollout_ref.actor.ppo_micro_batch_size, "
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
)


def _build_actor_config(actor: dict[str, Any]) -> None:
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    omega_conf_to_dataclass(OmegaConf.create(actor))


@pytest.mark.usefixtures("ray_cluster")
def test_a_verl_check_failing_in_a_ray_worker_is_one_line_naming_its_keys() -> None:
    import ray
    from omegaconf import OmegaConf

    config = compose_config(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null"])
    actor = OmegaConf.to_container(config.actor_rollout_ref.actor, resolve=True)
    with pytest.raises(ray.exceptions.RayTaskError) as raised:
        ray.get(ray.remote(_build_actor_config).remote(actor))
    assert verl_check_line(raised.value, leaf_keys(config)) == MICRO_BATCH_LINE


def test_an_error_raised_outside_verl_or_outside_a_worker_gets_no_line() -> None:
    assert verl_check_line(ValueError("not from a worker"), leaf_keys(compose_config())) is None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_production_run_that_fails_a_verl_check_in_its_workers_says_so_in_one_line_with_exit_code_2(
    tmp_path: Path,
) -> None:
    from agl_trainer.verl_glue.cpu_platform import CPU_MODE_OVERRIDES

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"x": 1}\n')
    command = [
        str(Path(sys.executable).with_name("agl-trainer")),
        *CPU_MODE_OVERRIDES,
        f"actor_rollout_ref.model.path={build_tiny_model(tmp_path / 'model')}",
        "agentlightning.agl_base_url=http://127.0.0.1:1",
        "agentlightning.external_servers.endpoints=[http://127.0.0.1:1/v1]",
        f"data.train_files={rows}",
        f"data.val_files={rows}",
        f"trainer.default_local_dir={tmp_path / 'outputs'}",
        "trainer.n_gpus_per_node=1",
        "data.train_batch_size=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
    ]
    env = {**os.environ, "VERL_PLATFORM": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=540, check=False, env=env)
    assert (done.returncode, done.stderr.splitlines()[-1]) == (2, MICRO_BATCH_LINE), done.stderr[-3000:]
