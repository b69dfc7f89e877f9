"""agl's ``routed_experts`` equals Agent Lightning 1.0.2's on the same calls.

The reference's tensor builder is read from the agentlightning package installed in agl-server's
tool environment (the package the tests run as the execution side) and run here on hypothesis-
drawn calls beside agl's adapter: same tensor, or both refuse routes too short for their call.
"""

from __future__ import annotations

import ast
import base64
import io
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_adapter import InvalidRoutesError, RolloutAdapter
from agl_testing.agl_server import find_agl_server, require_agl_server
from agl_testing.routes import npy_payload, succeeded_rollout
from agl_types import Triplet

REFERENCE_FILE = "verl/rollout_adapter.py"
REFERENCE_FUNCTION = "_build_routed_experts_batch"

ReferenceBuilder = Callable[[list[tuple[str, int, int, int]], int, int, torch.device], torch.Tensor]


@pytest.fixture(scope="module")
def reference_builder() -> ReferenceBuilder:
    require_agl_server()
    python = find_agl_server().parent / "python"
    locate = "import importlib.util as u; print(u.find_spec('agentlightning').submodule_search_locations[0])"
    package = Path(
        subprocess.run([python, "-c", locate], check=True, capture_output=True, text=True).stdout.strip()
    )
    tree = ast.parse((package / REFERENCE_FILE).read_text())
    found: list[ast.stmt] = [
        node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == REFERENCE_FUNCTION
    ]
    assert found, f"{package / REFERENCE_FILE} has no {REFERENCE_FUNCTION}: agentlightning >= 1.0.2 has it"
    module = ast.Module(body=found, type_ignores=[])
    namespace: dict[str, Any] = {"np": np, "torch": torch, "base64": base64, "io": io}
    exec(
        compile("from __future__ import annotations\n" + ast.unparse(module), REFERENCE_FILE, "exec"),
        namespace,
    )
    return namespace[REFERENCE_FUNCTION]


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.lists(st.integers(1, 99), min_size=1, max_size=10),
    response=st.lists(st.integers(1, 99), min_size=1, max_size=10),
    surplus=st.integers(-2, 3),
    p=st.integers(1, 8),
    r=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_routed_experts_equal_the_references_on_the_same_call(
    reference_builder: ReferenceBuilder,
    prompt: list[int],
    response: list[int],
    surplus: int,
    p: int,
    r: int,
    seed: int,
) -> None:
    n_routes = max(len(prompt) + len(response) - 1 + surplus, 0)
    routes = np.random.default_rng(seed).integers(0, 256, size=(n_routes, 3, 2), dtype=np.int32)
    payload = npy_payload(routes)
    rollout = succeeded_rollout(
        [Triplet(prompt_token_ids=prompt, response_token_ids=response, routed_experts=payload)]
    )
    adapter = RolloutAdapter(
        max_prompt_length=p, max_response_length=r, pad_token_id=0, trace_aggregator_level="transition"
    )
    kept = (payload, len(prompt), min(len(prompt), p), min(len(response), r))
    if surplus < 0 and n_routes < kept[1] + kept[3] - 1:
        with pytest.raises(RuntimeError, match="shorter than its token sequence"):
            reference_builder([kept], p, r, torch.device("cpu"))
        with pytest.raises(InvalidRoutesError, match="routed_experts covers"):
            adapter.build_batch([rollout])
        return
    theirs = reference_builder([kept], p, r, torch.device("cpu"))
    ours = adapter.build_batch([rollout])[0].routed_experts
    assert ours is not None
    assert ours.dtype == theirs.dtype == torch.uint8
    assert torch.equal(ours, theirs)
