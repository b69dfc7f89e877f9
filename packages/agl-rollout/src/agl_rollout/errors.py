"""The exceptions of agl-rollout; each says what failed, with which value, and what to do."""

from __future__ import annotations


class AglServerError(RuntimeError):
    """A call to agl-server failed for good (after any retries it was allowed)."""


class AglHTTPError(AglServerError):
    """The server answered with an error status; ``detail`` quotes the server's own message."""

    def __init__(self, method: str, url: str, status_code: int, detail: object) -> None:
        self.method = method
        self.url = url
        self.status_code = status_code
        self.detail = detail
        super().__init__(f"{method} {url} -> HTTP {status_code}: {detail}")


class AglUnavailableError(AglServerError):
    """The server could not be reached (connection errors or timeouts on every try)."""


class RolloutsLostError(AglServerError):
    """Rollouts this client was waiting for keep vanishing from the server (a foreign delete).

    A server restart is not an error: the managers re-create what it lost (:mod:`agl_rollout.recovery`).
    """

    def __init__(self, base_url: str, rollout_ids: list[str], reason: str) -> None:
        self.rollout_ids = rollout_ids
        shown = ", ".join(rollout_ids[:5]) + (" ..." if len(rollout_ids) > 5 else "")
        super().__init__(
            f"{len(rollout_ids)} rollout(s) vanished from agl-server at {base_url} ({reason}): {shown}. "
            "Something deletes the rollouts of this trainer: check for a second trainer or a cleanup job "
            "using this server."
        )


__all__ = ("AglHTTPError", "AglServerError", "AglUnavailableError", "RolloutsLostError")
