"""Exceptions of a weight push to external vLLM servers; each message names the endpoint."""


class WeightPushError(RuntimeError):
    """vLLM did not reload the pushed weights, or serves different weights than expected."""


class UnchangedWeightsError(WeightPushError):
    """vLLM's log-probs of the probe did not move on a reload: the reload was ignored, or the
    folder holds the weights vLLM already had."""
