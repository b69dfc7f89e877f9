"""Exceptions of a weight push to external vLLM servers; each message names the endpoint."""

from __future__ import annotations


class WeightPushError(RuntimeError):
    """vLLM did not reload the pushed weights, or serves different weights than expected.

    ``failures`` (endpoint -> one-line error) names each server a push to several failed on, after
    all were tried; the servers not in it serve the new version. Empty for a single server's error.
    """

    def __init__(self, message: str, failures: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[str, str] = dict(failures or {})


class UnchangedWeightsError(WeightPushError):
    """vLLM's log-probs of the probe did not move on a reload: the reload was ignored, or the
    folder holds the weights vLLM already had."""
