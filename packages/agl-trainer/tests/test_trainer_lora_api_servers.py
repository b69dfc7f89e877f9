"""A LoRA run refuses a vLLM server that runs several API servers, whose adapter-route state
(the current adapter, the calls in flight) each process would hold on its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from agl_testing.api_servers import one_of_several_api_servers
from agl_trainer.errors import ServerSetupError
from agl_trainer.serving.lora import ExternalLoraPush

pytestmark = pytest.mark.verl


class AdapterSavingActor:
    """Saves a small PEFT-like folder as its adapter; nothing is loaded from it before the refusal."""

    def save_lora_adapter(self, path: Path) -> Path:
        path.mkdir(parents=True)
        (path / "adapter_config.json").write_text("{}")
        return path


def test_the_first_lora_push_to_a_server_with_several_api_servers_is_refused_in_one_line_naming_it(
    tmp_path: Path,
) -> None:
    with one_of_several_api_servers() as endpoint:
        pusher = ExternalLoraPush([endpoint], "m", tmp_path / "weights")
        with pytest.raises(ServerSetupError) as caught:
            pusher.push(cast(Any, AdapterSavingActor()), 0)
    message = str(caught.value)
    assert message == (
        f"{endpoint.removesuffix('/v1')} runs several vLLM API servers (ApiServer_0 answered), each with "
        "its own current LoRA adapter: start it with --api-server-count 1 to train LoRA adapters"
    )
    assert "\n" not in message
    assert pusher.served_version is None
