"""The staleness gate on hand-built groups: ages from the oldest call, the bound, unknown versions."""

from __future__ import annotations

import pytest

from agl_rollout import CarriedGroup, StalenessGate, group_age
from agl_types import CompletedRollout, RolloutState, Triplet


def _group(*versions: int | None) -> CarriedGroup:
    """One complete group whose single rollout made one model call per entry of ``versions``."""
    triplets = [
        Triplet(
            prompt_token_ids=[1],
            response_token_ids=[2],
            metadata={} if v is None else {"server": {"version": v}},
        )
        for v in versions
    ]
    rollout = CompletedRollout(
        rollout_id="r",
        data_id="d",
        step=1,
        sample_idx_in_step=0,
        enqueue_time=0.0,
        triplets=triplets,
        rollout_state=RolloutState.SUCCEEDED,
    )
    return CarriedGroup(data_id="d", first_step=1, completed=[rollout])


def test_age_is_measured_from_the_oldest_call() -> None:
    assert group_age(_group(2, 4), trained_version=5) == 3


def test_a_group_without_recorded_versions_has_no_age_and_is_never_stale() -> None:
    group = _group(None, None)
    assert group_age(group, trained_version=9) is None
    assert not StalenessGate(max_staleness=0).is_stale(group, trained_version=9)


@pytest.mark.parametrize(("bound", "stale"), [(0, True), (2, True), (3, False), (None, False)])
def test_a_group_is_stale_exactly_when_its_age_exceeds_the_bound(bound: int | None, stale: bool) -> None:
    assert StalenessGate(max_staleness=bound).is_stale(_group(2, 4), trained_version=5) is stale


def test_bound_zero_keeps_only_groups_of_the_trained_version() -> None:
    fresh, stale = StalenessGate(max_staleness=0).split([_group(5), _group(4, 5), _group(5, 5)], 5)
    assert [group_age(g, 5) for g in fresh] == [0, 0]
    assert [group_age(g, 5) for g in stale] == [1]


def test_a_negative_bound_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        StalenessGate(max_staleness=-1)


def test_an_unknown_strategy_is_refused_listing_the_supported_ones() -> None:
    with pytest.raises(
        ValueError, match=r"Unsupported stale strategy: 'wait'. Supported: \['drop', 'requeue'\]"
    ):
        StalenessGate(max_staleness=1, strategy="wait")  # pyright: ignore[reportArgumentType]
