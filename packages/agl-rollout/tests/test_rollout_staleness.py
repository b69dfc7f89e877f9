"""The staleness gate on hand-built groups: ages from the oldest call, the bound, unknown versions."""

from __future__ import annotations

import pytest

from agl_rollout import Admission, CarriedGroup, StalenessGate, group_age, is_ahead
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


def test_a_group_with_a_call_newer_than_the_trained_weights_is_ahead() -> None:
    assert is_ahead(_group(3, 6), trained_version=5)
    assert not is_ahead(_group(3, 5), trained_version=5)
    assert not is_ahead(_group(None), trained_version=0)


@pytest.mark.parametrize(
    ("admission", "between_steps", "while_training"),
    [
        (Admission(4, 4, 0, overlap=False), 4, 0),  # sync: one generation batch, after the publish
        (Admission(2, 5, None, overlap=False), 5, 0),  # carry-over: more than a step, between steps
        (Admission(2, 8, 0, overlap=True), 2, 0),  # fully async, K=0: on-policy
        (Admission(2, 8, 2, overlap=True), 6, 4),  # fully async, K=2: (K+1) x G, then K x G
        (Admission(2, 5, 2, overlap=True), 5, 4),  # capped by max_groups
        (Admission(2, 7, None, overlap=True), 7, 7),  # no bound: max_groups all the time
    ],
)
def test_admission_limit_between_steps_and_while_a_taken_step_trains(
    admission: Admission, between_steps: int, while_training: int
) -> None:
    assert admission.limit(step_open=False) == between_steps
    assert admission.limit(step_open=True) == while_training


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 4, 0), "groups_per_step must be >= 1, got 0"),
        ((4, 3, 0), r"max_groups \(3\) must be >= groups_per_step \(4\)"),
        ((4, 4, -1), "max_staleness must be >= 0 or None"),
    ],
)
def test_an_impossible_admission_rule_is_refused_naming_the_value(
    args: tuple[int, int, int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Admission(*args, overlap=True)
