"""Weights uploaded over HTTP into a folder on the vLLM server's own disk, for a reload from there.

Served by the ``agl_adapter_route`` middleware (the one ``--middleware`` agl's servers run with),
so a trainer on another machine gets its weights to the server with no shared filesystem:

- ``PUT /agl/weights/<name>/<file>``: one file of the folder ``<name>`` (a weight version, e.g.
  ``step_3`` or ``adapter_3``), its body the file's bytes, ``Content-Length`` required. It lands in
  a hidden ``.incoming-<name>`` folder; ``<file>`` may hold ``/`` (subfolders), each segment a plain
  name.
- ``POST /agl/weights/<name>`` ``{"files": {<file>: <size>}, "keep": [<name>, ...]}``: the commit.
  The incoming folder must hold exactly those files at those sizes; it is then renamed to
  ``<name>`` (a version's folder appears whole or not at all), and every other staged folder not
  named in ``keep`` is removed. Answers ``{"path": <the folder on this server>}``, the path the
  trainer then asks vLLM to reload (or load an adapter) from.
- ``DELETE /agl/weights/<name>``: removes ``<name>`` and its incoming folder (an upload that starts
  again).
- ``GET /agl/weights``: ``{"staging_dir": ..., "staged": [<name>, ...]}``.

The folder is :data:`STAGING_DIR_ENV` when set; otherwise a temporary folder of this process,
removed when it exits. Uploads are bounded: a file larger than the staging disk's free space less
:data:`RESERVE_BYTES` is refused (507), and so is one that would take the staged bytes over
:data:`MAX_BYTES_ENV` when set (413). One upload at a time per server: a commit removes the
other versions' folders, finished or not.

Like vLLM's own admin routes (``/collective_rpc`` in dev mode), these are not authenticated:
only the trainer's network may reach the server's port.

Runs in vLLM's environment, which has no agl package: standard library only.
"""

import asyncio
import atexit
import json
import os
import re
import shutil
import tempfile
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

PREFIX = "/agl/weights"
STAGING_DIR_ENV = "AGL_VLLM_STAGING_DIR"
"""The server's staging folder (default: a temporary folder of its own)."""
MAX_BYTES_ENV = "AGL_VLLM_STAGING_MAX_BYTES"
"""The most bytes the staging folder may hold, all versions together (default: no bound but the disk's)."""
RESERVE_BYTES = 1 << 30
"""Bytes an upload leaves free on the staging disk."""
INCOMING = ".incoming-"
_WRITE_BYTES = 8 << 20
_SEGMENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class UploadRefused(Exception):
    """An upload or commit that cannot be taken: its HTTP status and one line saying why."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status


class WeightStaging:
    """The ``/agl/weights`` routes over one staging folder."""

    def __init__(self, root: Path | None, max_bytes: int | None) -> None:
        self._root = root
        self.max_bytes = max_bytes

    @classmethod
    def from_env(cls) -> "WeightStaging":
        root = os.environ.get(STAGING_DIR_ENV) or None
        max_bytes = os.environ.get(MAX_BYTES_ENV) or None
        return cls(Path(root) if root else None, int(max_bytes) if max_bytes else None)

    @property
    def root(self) -> Path:
        """The staging folder, created at first use (a temporary one removed at exit when none is set)."""
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="agl-vllm-staging-"))
            atexit.register(shutil.rmtree, self._root, True)
        self._root.mkdir(parents=True, exist_ok=True)
        return self._root

    @staticmethod
    def handles(path: str) -> bool:
        return path.rstrip("/") == PREFIX or path.startswith(PREFIX + "/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope.get("method", "")
        name, _, file = scope.get("path", "")[len(PREFIX) :].strip("/").partition("/")
        try:
            if not name and method == "GET":
                await answer(send, 200, {"staging_dir": str(self.root), "staged": self.staged()})
            elif _plain(name) and file and method == "PUT":
                await self._receive_file(name, _relative(file), _content_length(scope), receive)
                await answer(send, 200, {"received": file})
            elif _plain(name) and not file and method == "POST":
                payload = json.loads(await read_body(receive) or b"null")
                files, keep = _manifest(payload)
                path = await asyncio.to_thread(self._commit, name, files, keep)
                await answer(send, 200, {"path": str(path)})
            elif _plain(name) and not file and method == "DELETE":
                await asyncio.to_thread(self._remove, name)
                await answer(send, 200, {"removed": name})
            else:
                raise UploadRefused(
                    404, f"no route {method} {scope.get('path')}: see the agl_weight_staging module"
                )
        except UploadRefused as refused:
            await answer(send, refused.status, {"error": str(refused)})
        except ValueError as exc:
            await answer(send, 400, {"error": f"expected a JSON object body: {exc}"})
        except OSError as exc:
            await answer(send, 500, {"error": f"the staging folder {self.root}: {exc}"})

    def staged(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))

    async def _receive_file(self, name: str, file: Path, length: int, receive: Receive) -> None:
        await asyncio.to_thread(self._check_room, length)
        target = self.root / f"{INCOMING}{name}" / file
        await asyncio.to_thread(target.parent.mkdir, parents=True, exist_ok=True)
        handle = await asyncio.to_thread(target.open, "wb")
        written, pending = 0, bytearray()
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise UploadRefused(
                        400, f"the upload of {file} stopped after {written} of {length} bytes"
                    )
                pending += message.get("body", b"")
                if len(pending) >= _WRITE_BYTES or not message.get("more_body", False):
                    written += len(pending)
                    await asyncio.to_thread(handle.write, bytes(pending))
                    pending.clear()
                if not message.get("more_body", False):
                    break
            if written != length:
                raise UploadRefused(400, f"{file}: received {written} bytes, Content-Length said {length}")
        except BaseException:
            handle.close()
            target.unlink(missing_ok=True)
            raise
        await asyncio.to_thread(handle.close)

    def _check_room(self, length: int) -> None:
        free = shutil.disk_usage(self.root).free - RESERVE_BYTES
        if length > free:
            raise UploadRefused(
                507, f"{length} bytes do not fit in the staging folder {self.root} ({max(free, 0)} free)"
            )
        if self.max_bytes is not None:
            held = sum(f.stat().st_size for f in self.root.rglob("*") if f.is_file())
            if held + length > self.max_bytes:
                raise UploadRefused(
                    413,
                    f"{length} more bytes would take the staging folder over {MAX_BYTES_ENV}="
                    f"{self.max_bytes} ({held} held)",
                )

    def _commit(self, name: str, files: dict[str, int], keep: set[str]) -> Path:
        incoming = self.root / f"{INCOMING}{name}"
        held = {
            f.relative_to(incoming).as_posix(): f.stat().st_size
            for f in (incoming.rglob("*") if incoming.is_dir() else ())
            if f.is_file()
        }
        if held != files:
            differing = sorted(set(held.items()) ^ set(files.items()))
            raise UploadRefused(
                409, f"{name} does not hold the files of its manifest: first difference {differing[0]}"
            )
        target = self.root / name
        shutil.rmtree(target, ignore_errors=True)
        incoming.rename(target)
        for other in self.root.iterdir():
            if other.name.removeprefix(INCOMING) not in keep | {name}:
                shutil.rmtree(other, ignore_errors=True) if other.is_dir() else other.unlink()
        return target

    def _remove(self, name: str) -> None:
        for folder in (self.root / name, self.root / f"{INCOMING}{name}"):
            shutil.rmtree(folder, ignore_errors=True)


def _plain(segment: str) -> bool:
    return bool(_SEGMENT.match(segment))


def _relative(file: str) -> Path:
    parts = file.split("/")
    if not all(_plain(part) for part in parts):
        raise UploadRefused(400, f"{file!r} is not a relative path of plain names")
    return Path(*parts)


def _content_length(scope: Scope) -> int:
    for key, value in scope.get("headers", []):
        if key.lower() == b"content-length" and value.isdigit():
            return int(value)
    raise UploadRefused(411, "an upload needs a Content-Length")


def _manifest(payload: Any) -> tuple[dict[str, int], set[str]]:
    files = payload.get("files") if isinstance(payload, dict) else None
    keep = payload.get("keep", []) if isinstance(payload, dict) else None
    if (
        not isinstance(files, dict)
        or not files
        or not all(isinstance(k, str) and type(v) is int for k, v in files.items())
        or not isinstance(keep, list)
        or not all(isinstance(k, str) for k in keep)
    ):
        raise UploadRefused(400, 'expected {"files": {<file>: <size>, ...}, "keep": [<name>, ...]}')
    return {_relative(k).as_posix(): v for k, v in files.items()}, set(keep)


async def read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def answer(send: Send, status: int, content: dict[str, Any]) -> None:
    body = json.dumps(content).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
