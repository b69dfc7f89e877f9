"""The toy tasks' heavy-tailed tool latency: lognormal with the given median and 99th percentile, seeded."""

from __future__ import annotations

import statistics

import pytest

from agl_trainer.local import ToolLatency


def test_draws_have_the_given_median_and_99th_percentile() -> None:
    latency = ToolLatency.parse("0.5:6", seed=1)
    draws = sorted(latency.sample() for _ in range(20_000))
    assert statistics.median(draws) == pytest.approx(0.5, rel=0.05)
    assert draws[int(0.99 * len(draws))] == pytest.approx(6.0, rel=0.15)


def test_the_same_seed_gives_the_same_draws() -> None:
    first, second = ToolLatency(0.5, 6.0, seed=7), ToolLatency(0.5, 6.0, seed=7)
    assert [first.sample() for _ in range(5)] == [second.sample() for _ in range(5)]


@pytest.mark.parametrize("text", ["0.5", "fast:6", "2:1", "0:1"])
def test_a_malformed_latency_is_refused_naming_the_shortcut(text: str) -> None:
    with pytest.raises(ValueError, match=r"tool_latency="):
        ToolLatency.parse(text)
