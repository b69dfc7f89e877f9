"""Exceptions of a weight push to external vLLM servers; each message names the endpoint."""

from __future__ import annotations

from collections.abc import Mapping


class WeightPushError(RuntimeError):
    """vLLM did not take the pushed weights, or serves different weights than expected.

    ``failures``: each endpoint that failed and its one-line error, when the push went to several
    servers at once (the others, tried to the end, took the weights); empty for one server's own
    error.
    """

    def __init__(self, message: str, failures: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[str, str] = dict(failures or {})


class UnchangedWeightsError(WeightPushError):
    """vLLM's log-probs of the probe did not move on a reload: the reload was ignored, or the
    folder holds the weights vLLM already had."""
