"""agl_testing.listening reads a process's listening sockets, with their addresses, from /proc."""

from __future__ import annotations

import os
import socket

from agl_testing.listening import beyond_loopback, listeners, process_tree


def _port(server: socket.socket) -> int:
    return int(server.getsockname()[1])


def test_listeners_are_read_with_their_addresses_and_those_beyond_loopback_named() -> None:
    with (
        socket.create_server(("127.0.0.1", 0)) as local,
        socket.create_server(("0.0.0.0", 0)) as anywhere,
        socket.create_server(("::1", 0), family=socket.AF_INET6) as local6,
    ):
        ports = {_port(local), _port(anywhere), _port(local6)}
        found = [item for item in listeners([os.getpid()]) if item.port in ports]
        assert sorted((item.address, item.port) for item in found) == sorted(
            [("127.0.0.1", _port(local)), ("0.0.0.0", _port(anywhere)), ("::1", _port(local6))]
        )
        assert [(item.address, item.port) for item in beyond_loopback(found)] == [
            ("0.0.0.0", _port(anywhere))
        ]


def test_the_process_tree_holds_the_process_and_its_children() -> None:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        tree = process_tree(os.getpid())
        assert tree[0] == os.getpid() and child.pid in tree
    finally:
        child.kill()
        child.wait()
