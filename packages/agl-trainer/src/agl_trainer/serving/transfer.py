"""Getting a weights folder of the trainer's to N vLLM servers at once, and what failed where.

``upload`` (the default): each file goes over HTTP into the server's own staging folder
(``agl_weight_staging``, served by agl's middleware), so no server needs to see the trainer's
``weights_dir``. ``shared_folder``: the servers read the trainer's folder itself, which they must
see at the same path (one machine, or a shared filesystem); nothing moves. Every server is tried
at once; one that fails does not stop the others.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import httpx

from agl_trainer.serving.errors import UnchangedWeightsError, WeightPushError
from agl_trainer.serving.vllm_client import VllmClient, server_root

if TYPE_CHECKING:
    from agl_trainer.settings.server import Transfer

T = TypeVar("T")


def on_each(endpoints: Sequence[str], job: Callable[[str], T]) -> tuple[dict[str, T], dict[str, str]]:
    """``job(endpoint)`` for every endpoint at once, each to its end: the results of those that
    succeeded and the one-line error of each that failed (a :class:`WeightPushError` or an HTTP error)."""
    if not endpoints:
        return {}, {}
    results: dict[str, T] = {}
    failures: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=len(endpoints), thread_name_prefix="agl-push") as pool:
        futures = {endpoint: pool.submit(job, endpoint) for endpoint in endpoints}
        for endpoint, future in futures.items():
            try:
                results[endpoint] = future.result()
            except (WeightPushError, httpx.HTTPError, OSError) as exc:
                failures[endpoint] = one_line(exc)
    return results, failures


def one_line(exc: BaseException) -> str:
    """An error on one line: a push error's message, an HTTP or OS error's kind and message."""
    text = str(exc) if isinstance(exc, WeightPushError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split()) or type(exc).__name__


def push_failed(
    what: str, n_servers: int, failures: Mapping[str, str], *, unchanged: bool = False
) -> WeightPushError:
    """The error of a push or stage of ``what`` that failed on ``failures``' endpoints out of ``n_servers``;
    an :class:`UnchangedWeightsError` when every failure was a reload that changed nothing."""
    named = "; ".join(f"{endpoint}: {error}" for endpoint, error in failures.items())
    message = (
        f"{what} did not reach {len(failures)} of {n_servers} vLLM server(s) ({named}); "
        "check agentlightning.external_servers.endpoints"
    )
    return (UnchangedWeightsError if unchanged else WeightPushError)(message, failures)


def place(
    transfer: Transfer,
    endpoints: Sequence[str],
    model: str,
    folder: Path,
    *,
    name: str | None = None,
    keep: Sequence[str] = (),
) -> tuple[dict[str, str], dict[str, str]]:
    """Make ``folder`` readable by each server: the path each reads it at, and the failures.

    An upload stages it as ``name`` (default: ``folder``'s name) and removes the server's other
    staged folders except those named in ``keep``.
    """
    if transfer == "shared_folder":
        return {endpoint: str(folder) for endpoint in endpoints}, {}

    def upload(endpoint: str) -> str:
        with VllmClient(server_root(endpoint), model) as client:
            return client.stage_folder(name or folder.name, folder, keep=keep)

    return on_each(endpoints, upload)


__all__ = ("on_each", "one_line", "place", "push_failed")
