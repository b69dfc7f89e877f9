"""Bounded retry with exponential backoff and jitter, for idempotent calls only."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often and how long a call is retried after a transport error or a 5xx answer.

    The delay before try ``i + 1`` is ``min(base_delay_s * 2**i, max_delay_s)`` scaled by a
    uniform jitter in ``[1 - jitter, 1 + jitter]``; retrying stops after ``max_attempts``
    tries or once ``deadline_s`` seconds have passed since the first try, whichever is first.
    4xx answers are never retried: asking again would get the same answer. A call whose
    connection was reset or closed under it (a dropped response) is retried at once on a new
    connection, within ``max_attempts`` but without a delay: a drop costs a round trip, not a
    back-off. A server that is really gone refuses the new connection, and that backs off.
    """

    max_attempts: int = 8
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0
    jitter: float = 0.25
    deadline_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.base_delay_s < 0 or self.max_delay_s < self.base_delay_s:
            raise ValueError(
                f"RetryPolicy delays must satisfy 0 <= base_delay_s <= max_delay_s, got "
                f"base_delay_s={self.base_delay_s}, max_delay_s={self.max_delay_s}"
            )
        if not 0 <= self.jitter < 1:
            raise ValueError(f"RetryPolicy.jitter must be in [0, 1), got {self.jitter}")
        if self.deadline_s <= 0:
            raise ValueError(f"RetryPolicy.deadline_s must be > 0, got {self.deadline_s}")

    def delays(self) -> Iterator[float]:
        """The sleeps between tries: ``max_attempts - 1`` values."""
        for i in range(self.max_attempts - 1):
            base = min(self.base_delay_s * 2**i, self.max_delay_s)
            yield base * random.uniform(1 - self.jitter, 1 + self.jitter)


__all__ = ("RetryPolicy",)
