"""The vLLM middleware's weight uploads (``agl_weight_staging``), driven as the ASGI server drives it.

Real vLLM servers reload from what it staged in ``test_trainer_weights_upload.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from agl_testing.vllm_child import vllm_child_module

FILES = {"config.json": b'{"a": 1}', "model.safetensors": bytes(range(256)) * 40}


def _staging(root: Path | None, max_bytes: int | None = None) -> Any:
    return vllm_child_module("agl_weight_staging").WeightStaging(root, max_bytes)


def _request(
    route: Any, method: str, path: str, chunks: Sequence[bytes] = (b"",), *, length: bool = True
) -> tuple[int, dict[str, Any]]:
    """``method path`` with the body sent in ``chunks``; the status and the JSON answer."""
    pending = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [(b"content-length", str(sum(map(len, chunks))).encode())] if length else []
    asyncio.run(route({"type": "http", "method": method, "path": path, "headers": headers}, receive, send))
    return sent[0]["status"], json.loads(sent[1]["body"])


def _upload(
    route: Any, name: str, files: dict[str, bytes], keep: tuple[str, ...] = ()
) -> tuple[int, dict[str, Any]]:
    for file, content in files.items():
        assert _request(route, "PUT", f"/agl/weights/{name}/{file}", [content[:100], content[100:]])[0] == 200
    manifest = {"files": {file: len(content) for file, content in files.items()}, "keep": list(keep)}
    return _request(route, "POST", f"/agl/weights/{name}", [json.dumps(manifest).encode()])


def test_an_uploaded_version_appears_whole_at_its_commit_at_the_path_answered(tmp_path: Path) -> None:
    route = _staging(tmp_path / "staging")
    for file, content in FILES.items():
        _request(route, "PUT", f"/agl/weights/step_1/{file}", [content])
    before = _request(route, "GET", "/agl/weights")
    status, committed = _request(
        route,
        "POST",
        "/agl/weights/step_1",
        [json.dumps({"files": {f: len(c) for f, c in FILES.items()}}).encode()],
    )
    assert before == (200, {"staging_dir": str(tmp_path / "staging"), "staged": []})
    assert (status, committed) == (200, {"path": str(tmp_path / "staging" / "step_1")})
    assert {f.name: f.read_bytes() for f in (tmp_path / "staging" / "step_1").iterdir()} == FILES
    assert _request(route, "GET", "/agl/weights")[1]["staged"] == ["step_1"]


def test_a_commit_whose_manifest_differs_from_what_arrived_is_refused_and_stages_nothing(
    tmp_path: Path,
) -> None:
    route = _staging(tmp_path)
    _request(route, "PUT", "/agl/weights/step_1/config.json", [FILES["config.json"]])
    manifest = {"files": {"config.json": len(FILES["config.json"]), "model.safetensors": 10240}}
    status, answer = _request(route, "POST", "/agl/weights/step_1", [json.dumps(manifest).encode()])
    assert status == 409
    assert answer == {
        "error": "step_1 does not hold the files of its manifest: first difference ('model.safetensors', 10240)"
    }
    assert not (tmp_path / "step_1").exists()


def test_a_commit_removes_every_other_version_not_kept(tmp_path: Path) -> None:
    route = _staging(tmp_path)
    for version in (1, 2, 3):
        _upload(route, f"step_{version}", FILES)
    _request(route, "PUT", "/agl/weights/step_4/config.json", [b"{}"])  # an upload that never finished
    assert _upload(route, "step_5", FILES, keep=("step_3",))[0] == 200
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_5"]


def test_an_upload_that_stops_before_its_length_leaves_no_file(tmp_path: Path) -> None:
    route = _staging(tmp_path)
    pending = [{"type": "http.request", "body": b"abc", "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return pending.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "PUT",
        "path": "/agl/weights/step_1/w.bin",
        "headers": [(b"content-length", b"10")],
    }
    asyncio.run(route(scope, receive, send))
    assert sent[0]["status"] == 400
    assert json.loads(sent[1]["body"]) == {"error": "the upload of w.bin stopped after 0 of 10 bytes"}
    assert list((tmp_path / ".incoming-step_1").iterdir()) == []


def test_uploads_beyond_the_bound_or_without_a_length_are_refused(tmp_path: Path) -> None:
    route = _staging(tmp_path, max_bytes=1000)
    assert _request(route, "PUT", "/agl/weights/step_1/a", [b"x" * 600]) == (200, {"received": "a"})
    assert _request(route, "PUT", "/agl/weights/step_1/b", [b"x" * 600]) == (
        413,
        {
            "error": "600 more bytes would take the staging folder over AGL_VLLM_STAGING_MAX_BYTES=1000 (600 held)"
        },
    )
    assert _request(route, "PUT", "/agl/weights/step_1/c", [b"x"], length=False) == (
        411,
        {"error": "an upload needs a Content-Length"},
    )
    assert sorted(p.name for p in (tmp_path / ".incoming-step_1").iterdir()) == ["a"]


@pytest.mark.parametrize(
    ("path", "status"),
    [("/agl/weights/step_1/../x", 400), ("/agl/weights/step_1/.hidden", 400), ("/agl/weights/..%2Fx/a", 404)],
)
def test_a_file_or_version_name_that_is_not_a_plain_name_is_refused(
    tmp_path: Path, path: str, status: int
) -> None:
    assert _request(_staging(tmp_path / "staging"), "PUT", path, [b"x"])[0] == status
    assert list(tmp_path.iterdir()) == []  # nothing written anywhere


def test_without_a_folder_set_the_server_stages_in_a_temporary_folder_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = vllm_child_module("agl_weight_staging")
    monkeypatch.delenv(module.STAGING_DIR_ENV, raising=False)
    one, other = module.WeightStaging.from_env(), module.WeightStaging.from_env()
    assert one.root != other.root
    assert one.root.name.startswith("agl-vllm-staging-")
    monkeypatch.setenv(module.STAGING_DIR_ENV, str(tmp_path / "set"))
    assert module.WeightStaging.from_env().root == tmp_path / "set"
