"""agl's vision tensors equal Agent Lightning 1.0.2's on the same rollouts.

The reference's ``RolloutAdapter`` (``verl/rollout_adapter.py``, with the ``Triplet`` and
``CompletedRollout`` models of ``verl/agl_rollout_manager.py``, and ``schemas.RolloutState``) is read from the agentlightning
package installed in agl-server's tool environment and run here, beside agl's adapter, on
hypothesis-drawn transition-level rollouts with images (the reference refuses images at trajectory
level) through the same tiny Qwen2-VL processor, with verl's bound ``get_rope_index`` and without
it (the reference then recognises Qwen-VL by class and calls verl's own helper): the same
``input_ids``, ``attention_mask``, ``position_ids`` and per-row ``multi_modal_inputs``.
"""

from __future__ import annotations

import ast
import base64
import io
import json
import subprocess
import zipfile
from enum import StrEnum
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field
from tensordict import TensorDict
from verl import DataProto

from agl_adapter import RolloutAdapter
from agl_testing.agl_server import find_agl_server, require_agl_server
from agl_testing.routes import succeeded_rollout
from agl_testing.vision import placeholder, png_data_url, tiny_vl_processor
from agl_types import Triplet

pytestmark = pytest.mark.verl

SOURCES = (
    ("schemas.py", ("RolloutState",)),
    ("verl/agl_rollout_manager.py", ("Triplet", "CompletedRollout")),
    ("verl/rollout_adapter.py", None),
)


def _body(path: Path, keep: tuple[str, ...] | None = None) -> ast.Module:
    """The module's top-level definitions (only ``keep`` when given), without its imports."""
    nodes: list[ast.stmt] = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            continue
        name = getattr(node, "name", None)
        if keep is None or name in keep:
            nodes.append(node)
    return ast.Module(body=nodes, type_ignores=[])


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    require_agl_server()
    python = find_agl_server().parent / "python"
    locate = "import importlib.util as u; print(u.find_spec('agentlightning').submodule_search_locations[0])"
    package = Path(
        subprocess.run([python, "-c", locate], check=True, capture_output=True, text=True).stdout.strip()
    )
    namespace: dict[str, Any] = {
        "Any": Any,
        "BaseModel": BaseModel,
        "DataProto": DataProto,
        "Field": Field,
        "StrEnum": StrEnum,
        "TensorDict": TensorDict,
        "base64": base64,
        "cast": cast,
        "io": io,
        "json": json,
        "np": np,
        "torch": torch,
        "zipfile": zipfile,
    }
    for name, keep in SOURCES:
        source = "from __future__ import annotations\n" + ast.unparse(_body(package / name, keep))
        exec(compile(source, str(package / name), "exec"), namespace)
    for model in ("Triplet", "CompletedRollout"):
        namespace[model].model_rebuild(_types_namespace=namespace)
    assert "image_urls" in namespace["Triplet"].model_fields, "agentlightning >= 1.0.2 has image_urls"
    return namespace


@pytest.fixture(scope="module", params=[True, False], ids=["bound_rope_index", "unbound"])
def processor(request: pytest.FixtureRequest) -> Any:
    return tiny_vl_processor(bind_rope_index=request.param)


def _their_rollout(reference: dict[str, Any], triplets: list[Triplet]) -> Any:
    return reference["CompletedRollout"](
        rollout_id="r1",
        data_id="d1",
        step=0,
        sample_idx_in_step=0,
        enqueue_time=0.0,
        final_reward=1.0,
        triplets=[
            reference["Triplet"](
                prompt={"token_ids": t.prompt_token_ids},
                response={"token_ids": t.response_token_ids, "log_probs": None},
                image_urls=t.image_urls,
            )
            for t in triplets
        ],
    )


@st.composite
def _calls(draw: st.DrawFn, processor: Any) -> list[Triplet]:
    """One to three calls, each with zero to two images of 1 to 3 x 1 to 3 merged cells among text."""
    triplets: list[Triplet] = []
    for _ in range(draw(st.integers(1, 3))):
        prompt = draw(st.lists(st.integers(1, 99), min_size=1, max_size=3))
        urls: list[str] = []
        for _ in range(draw(st.integers(0, 2))):
            w, h, shade = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(0, 5))
            urls.append(png_data_url(w, h, shade))
            prompt += [*placeholder(processor, w, h), *draw(st.lists(st.integers(1, 99), max_size=2))]
        response = draw(st.lists(st.integers(1, 99), min_size=1, max_size=4))
        triplets.append(
            Triplet(prompt_token_ids=prompt, response_token_ids=response, image_urls=urls or None)
        )
    return triplets


@settings(max_examples=30, deadline=None)
@given(data=st.data(), spare_p=st.integers(-3, 3), spare_r=st.integers(-2, 3))
def test_vision_tensors_equal_the_references_on_the_same_rollout(
    reference: dict[str, Any], processor: Any, data: st.DataObject, spare_p: int, spare_r: int
) -> None:
    """Cut prompts (rows that never train) and cut responses included."""
    triplets = data.draw(_calls(processor))
    p = max(max(len(t.prompt_token_ids) for t in triplets) + spare_p, 1)
    r = max(max(len(t.response_token_ids) for t in triplets) + spare_r, 1)
    theirs, _ = reference["RolloutAdapter"](
        max_prompt_length=p,
        max_response_length=r,
        device=torch.device("cpu"),
        pad_token_id=0,
        trace_aggregator_level="transition",
        processor=processor,
    ).get_train_data_batch([_their_rollout(reference, triplets)])
    ours, _ = RolloutAdapter(
        max_prompt_length=p,
        max_response_length=r,
        pad_token_id=0,
        trace_aggregator_level="transition",
        processor=processor,
    ).build_batch([succeeded_rollout(triplets)])
    for key in ("input_ids", "attention_mask", "position_ids", "is_drop_mask"):
        assert torch.equal(getattr(ours, key), theirs.batch[key]), key
    their_inputs = theirs.non_tensor_batch.get("multi_modal_inputs")
    if ours.multi_modal_inputs is None:
        assert their_inputs is None
        return
    assert their_inputs is not None
    for row_ours, row_theirs in zip(ours.multi_modal_inputs, their_inputs, strict=True):
        if row_theirs is None:
            assert row_ours is None
            continue
        assert row_ours.keys() == row_theirs.keys()
        for key, value in row_theirs.items():
            assert torch.equal(row_ours[key], value), key
