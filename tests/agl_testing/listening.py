"""Which TCP sockets a tree of processes listens on, read from ``/proc`` (what ``ss -ltnp`` shows).

A socket is found by its inode: ``/proc/<pid>/net/tcp`` and ``tcp6`` list every listening socket of
the process's network namespace with its inode, and ``/proc/<pid>/fd/*`` links to
``socket:[<inode>]`` for each socket the process holds.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

_LISTEN = "0A"


@dataclass(frozen=True)
class Listener:
    """One listening TCP socket and the process that holds it."""

    pid: int
    command: str
    address: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port} ({self.command}, pid {self.pid})"


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it, by the parent pid each ``/proc/<pid>/stat`` gives."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone
        children.setdefault(ppid, []).append(int(proc.name))
    tree, pending = [], [root]
    while pending:
        pid = pending.pop()
        tree.append(pid)
        pending.extend(children.get(pid, []))
    return tree


def listeners(pids: list[int]) -> list[Listener]:
    """The listening TCP sockets (IPv4 and IPv6) that the processes ``pids`` hold."""
    found: list[Listener] = []
    for pid in pids:
        try:
            sockets = _listening_sockets(pid)
            inodes = _socket_inodes(pid)
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone
        found += [
            Listener(pid, command.strip()[:120], address, port)
            for inode, (address, port) in sockets.items()
            if inode in inodes
        ]
    return found


def beyond_loopback(found: list[Listener]) -> list[Listener]:
    """The listeners of ``found`` reachable from another machine: bound to any address but a
    loopback one (127.0.0.0/8, ::1, or 127.x written as an IPv4-mapped IPv6 address)."""
    return [listener for listener in found if not _is_loopback(listener.address)]


def _is_loopback(text: str) -> bool:
    address = ipaddress.ip_address(text)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def _listening_sockets(pid: int) -> dict[str, tuple[str, int]]:
    """inode -> (address, port) of each listening socket in the network namespace of ``pid``."""
    sockets: dict[str, tuple[str, int]] = {}
    for table in ("tcp", "tcp6"):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == _LISTEN:
                hex_address, _, hex_port = local.partition(":")
                sockets[inode] = (_address(hex_address), int(hex_port, 16))
    return sockets


def _address(hex_address: str) -> str:
    """The text of an address as ``/proc/net/tcp*`` writes it: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    swapped = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(swapped))


def _socket_inodes(pid: int) -> set[str]:
    inodes: set[str] = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


__all__ = ("Listener", "beyond_loopback", "listeners", "process_tree")
