"""Which processes on this machine show a secret on their command line (readable by every user)."""

from __future__ import annotations

import time
from pathlib import Path


class KeyScan:
    """Reads every process's ``/proc/<pid>/cmdline``; notes those that hold ``key`` in their argv, and
    which kinds of agl process hold it in their environment (proof the scan saw them running)."""

    KINDS = ("agentlightning.server", "agentlightning.controller", "_run_local_reconciler_worker")

    def __init__(self, key: str) -> None:
        self.key = key
        self.with_key_in_argv: list[str] = []
        self.holders: set[str] = set()

    def once(self) -> None:
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                argv = (proc / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
                environ = (proc / "environ").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue  # gone, or not ours
            if self.key in argv:
                self.with_key_in_argv.append(argv)
            if f"AGL_KEY={self.key}" in environ:
                self.holders.update(kind for kind in self.KINDS if kind in argv)

    def until_every_kind_seen(self, timeout: float = 60.0) -> None:
        """Scan every 0.1 s until each of :attr:`KINDS` was seen holding the key, or ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.holders >= set(self.KINDS):
            self.once()
            time.sleep(0.1)


def process_env(pid: int) -> dict[str, str]:
    """The environment of process ``pid`` (empty when it is gone or not readable)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def find_processes(argv_part: str, env_item: str) -> list[int]:
    """Pids whose command line contains ``argv_part`` and whose environment holds ``NAME=value`` ``env_item``."""
    found: list[int] = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        name, _, value = env_item.partition("=")
        if argv_part in argv and process_env(int(proc.name)).get(name) == value:
            found.append(int(proc.name))
    return found


__all__ = ("KeyScan", "find_processes", "process_env")
