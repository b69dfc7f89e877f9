"""A loopback HTTP/1.1 proxy that injects faults between a client and agl-server.

It relays one request at a time per client connection (keep-alive on both sides) and,
for requests matching a rule, either resets the client connection before forwarding
(``"reset"``: the server never sees the request) or forwards the request and resets the
client connection instead of relaying the answer (``"drop_response"``: the server acted,
the client never hears of it), or answers ``503 Service Unavailable`` itself without
forwarding (``"answer_503"``: a fake fault standing in for an overloaded server or a load
balancer with no healthy backend, which the real agl-server cannot be made to produce).
Every request it reads is logged in ``requests``, and the status of every response it relays in
``statuses``. Standard library only.
"""

from __future__ import annotations

import random
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Literal

Fault = Literal["reset", "drop_response", "answer_503"]

_BODY_503 = b'{"detail":"fake 503 injected by FaultProxy"}'
_ANSWER_503 = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    + f"Content-Length: {len(_BODY_503)}\r\n\r\n".encode()
    + _BODY_503
)


@dataclass
class FaultRule:
    method: str
    path_prefix: str
    fault: Fault
    remaining: int


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a crashed peer or a middlebox would."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass


def _read_message(sock: socket.socket, buffer: bytearray, *, is_response: bool) -> bytes | None:
    """One whole HTTP message (head and body) from ``sock``; ``None`` on EOF. ``buffer`` keeps
    bytes read past the message for the next call."""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buffer.extend(chunk)
    head_end = buffer.index(b"\r\n\r\n") + 4
    head = bytes(buffer[:head_end])
    lines = head.decode("latin-1").split("\r\n")
    headers = {
        k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)
    }
    if headers.get("transfer-encoding", "").lower() == "chunked":
        return _read_chunked(sock, buffer, head_end)
    status_no_body = is_response and lines[0].split(" ")[1] in {"204", "304"}
    length = 0 if status_no_body else int(headers.get("content-length", "0"))
    while len(buffer) < head_end + length:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buffer.extend(chunk)
    message = bytes(buffer[: head_end + length])
    del buffer[: head_end + length]
    return message


def _read_chunked(sock: socket.socket, buffer: bytearray, head_end: int) -> bytes | None:
    while b"\r\n0\r\n\r\n" not in buffer[head_end - 2 :]:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buffer.extend(chunk)
    end = buffer.index(b"\r\n0\r\n\r\n", head_end - 2) + 7
    message = bytes(buffer[:end])
    del buffer[:end]
    return message


class FaultProxy:
    """Listens on 127.0.0.1 and relays to ``127.0.0.1:target_port``; add rules with :meth:`inject`."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._rules: list[FaultRule] = []
        self._fraction: tuple[Fault, float, random.Random] | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.injected: list[tuple[str, str, Fault]] = []
        self.requests: list[tuple[str, str]] = []
        self.statuses: list[int] = []
        self._thread = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def inject(self, method: str, path_prefix: str, fault: Fault, *, times: int = 1) -> None:
        """Apply ``fault`` to the next ``times`` requests ``method path_prefix...``."""
        with self._lock:
            self._rules.append(FaultRule(method.upper(), path_prefix, fault, times))

    def inject_fraction(self, fault: Fault, fraction: float, *, seed: int = 0) -> None:
        """Apply ``fault`` to each request no rule matched with probability ``fraction`` (seeded)."""
        with self._lock:
            self._fraction = (fault, fraction, random.Random(seed))

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._listener.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _fault_for(self, request: bytes) -> Fault | None:
        method, path = request.split(b" ", 2)[:2]
        with self._lock:
            self.requests.append((method.decode(), path.decode()))
            for rule in self._rules:
                if (
                    rule.remaining > 0
                    and rule.method == method.decode()
                    and path.decode().startswith(rule.path_prefix)
                ):
                    rule.remaining -= 1
                    self.injected.append((rule.method, path.decode(), rule.fault))
                    return rule.fault
            if self._fraction is not None:
                fault, fraction, rng = self._fraction
                if rng.random() < fraction:
                    self.injected.append((method.decode(), path.decode(), fault))
                    return fault
        return None

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        client_buf, upstream_buf = bytearray(), bytearray()
        try:
            while not self._stopped.is_set():
                request = _read_message(client, client_buf, is_response=False)
                if request is None:
                    return
                fault = self._fault_for(request)
                if fault == "reset":
                    _reset(client)
                    return
                if fault == "answer_503":
                    client.sendall(_ANSWER_503)
                    continue
                if upstream is None:
                    upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=30)
                upstream.sendall(request)
                response = _read_message(upstream, upstream_buf, is_response=True)
                if response is None or fault == "drop_response":
                    _reset(client)
                    return
                with self._lock:
                    self.statuses.append(int(response.split(b" ", 2)[1]))
                client.sendall(response)
        except OSError:
            _reset(client)
        finally:
            if upstream is not None:
                upstream.close()
            client.close()


__all__ = ("Fault", "FaultProxy", "FaultRule")
