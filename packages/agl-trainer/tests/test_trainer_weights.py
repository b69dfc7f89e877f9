"""The external-server weight push: what it does when the servers already hold the weights."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest

from agl_trainer.serving.errors import WeightPushError
from agl_trainer.serving.weights import ExternalVllmPush

pytestmark = pytest.mark.verl

# Port 9 (discard) on loopback: a push that tried to reach this server would fail.
_UNREACHABLE = "http://127.0.0.1:9/v1"


def test_a_new_version_is_saved_then_an_unreachable_server_is_named(tmp_path: Path) -> None:
    saved: list[Path] = []

    class SavingWorkers:
        def save_hf_weights(self, path: Path) -> Path:
            saved.append(Path(path))
            return Path(path)

        def probe_logprobs(self, token_ids: Sequence[int]) -> list[float]:
            return [-1.0] * (len(token_ids) - 1)

    pusher = ExternalVllmPush([_UNREACHABLE], "m", tmp_path / "weights")
    with pytest.raises(
        WeightPushError, match=r"version 3 .* did not reach 1 of 1 .*http://127\.0\.0\.1:9/v1"
    ) as caught:
        pusher.push(cast(Any, SavingWorkers()), 3)
    assert saved == [tmp_path / "weights" / "step_3"]
    assert list(caught.value.failures) == [_UNREACHABLE]
    assert caught.value.failures[_UNREACHABLE].startswith("ConnectError: ")
    assert pusher.served_version is None


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
