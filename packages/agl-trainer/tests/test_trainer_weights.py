"""The external-server weight push: what it does when the servers already hold the weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from agl_trainer.serving.errors import WeightPushError
from agl_trainer.serving.weights import ExternalVllmPush, same_tensors

pytestmark = pytest.mark.verl

# Port 9 (discard) on loopback: a push that tried to reach this server would fail.
_UNREACHABLE = "http://127.0.0.1:9/v1"


def test_pushing_the_version_the_servers_serve_saves_and_reloads_nothing(tmp_path: Path) -> None:
    pusher = ExternalVllmPush([_UNREACHABLE], "m", tmp_path / "weights")
    no_workers = cast(Any, object())  # a push that saved weights would call no_workers.save_hf_weights
    assert pusher.push(no_workers, 0) == {"training/weight_version": 0.0}
    assert not (tmp_path / "weights").exists()


def test_a_new_version_is_saved_then_an_unreachable_server_is_named(tmp_path: Path) -> None:
    saved: list[Path] = []

    class SavingWorkers:
        def save_hf_weights(self, path: Path) -> Path:
            saved.append(Path(path))
            return Path(path)

    pusher = ExternalVllmPush([_UNREACHABLE], "m", tmp_path / "weights")
    with pytest.raises(
        WeightPushError, match=r"version 3 .* did not reach 1 of 1 .*http://127\.0\.0\.1:9/v1"
    ) as caught:
        pusher.push(cast(Any, SavingWorkers()), 3)
    assert saved == [tmp_path / "weights" / "step_3"]
    assert list(caught.value.failures) == [_UNREACHABLE]
    assert caught.value.failures[_UNREACHABLE].startswith("ConnectError: ")
    assert pusher.served_version == 0


def test_same_tensors_compares_values_across_dtypes_and_refuses_other_weights(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    def folder(name: str, tensors: dict[str, torch.Tensor]) -> Path:
        path = tmp_path / name
        path.mkdir()
        save_file(tensors, str(path / "model.safetensors"))
        return path

    weight = torch.tensor([[0.5, -1.25], [2.0, 0.0]])
    served = folder("served", {"w": weight})
    assert same_tensors(folder("copy", {"w": weight.to(torch.bfloat16)}), served)
    assert not same_tensors(folder("moved", {"w": weight + 0.5}), served)
    assert not same_tensors(folder("renamed", {"v": weight}), served)
    assert not same_tensors(tmp_path / "served", tmp_path / "nothing")


@pytest.mark.parametrize("lora", [[], ["actor_rollout_ref.model.lora_rank=8"]])
def test_external_servers_get_uploads_by_default_and_read_a_shared_folder_when_told(
    tmp_path: Path, lora: list[str]
) -> None:
    from agl_trainer.assembly import compose_config, default_weight_pusher
    from agl_trainer.settings import parse_settings

    external = [
        *lora,
        "agentlightning.external_servers.endpoints=[http://127.0.0.1:1/v1]",
        f"agentlightning.external_servers.weights_dir={tmp_path}",
    ]
    default = default_weight_pusher(parse_settings(compose_config(external)).server)
    shared = default_weight_pusher(
        parse_settings(
            compose_config([*external, "agentlightning.external_servers.transfer=shared_folder"])
        ).server
    )
    assert (cast(Any, default).transfer, cast(Any, shared).transfer) == ("upload", "shared_folder")
    with pytest.raises(
        ValueError,
        match=r"^agentlightning\.external_servers\.transfer='nfs'; supported: \['upload', 'shared_folder'\]$",
    ):
        parse_settings(compose_config([*external, "agentlightning.external_servers.transfer=nfs"]))
