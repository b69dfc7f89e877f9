"""Pure-Python behaviour of agl-rollout: conversion, batches, config, triplets, metrics, hooks loading."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from agl_rollout import (
    AglClient,
    AsyncRolloutManager,
    BatchTopUp,
    HookRunner,
    RetryPolicy,
    RolloutHooks,
    RolloutManagerConfig,
    WaitCounts,
    WaitProgress,
    batch_rows,
    extract_triplets,
    image_urls_per_call,
    lifecycle_metrics,
    load_hooks,
    model_registrations,
    percentile,
    record_lifecycle,
    request_image_urls,
    served_adapter_versions,
    served_endpoints,
    to_native,
)
from agl_rollout.pacing import SweepPacer
from agl_types import CompletedRollout, EnqueuedRollout, Event, Rollout, RolloutState

pytestmark = pytest.mark.timeout(60)


def _event(event_type: str, data: dict[str, Any]) -> Event:
    return Event(event_type=event_type, rollout_id="r", attempt_id="0", timestamp=0.0, data=data)


def _triplet_request(prompt: list[int], response: list[int], **extra: Any) -> Event:
    data: dict[str, Any] = {
        "prompt_token_ids": prompt,
        "response_token_ids": response,
        "response_log_probs": [-0.5] * len(response),
        "server": {"model": "m", "version": 3},
        "http_status": 200,
        "status": "ok",
    }
    return _event("model_request", {**data, **extra})


class _FakeArray:
    """Duck-types a numpy array / torch tensor: only ``tolist`` (what to_native relies on)."""

    def __init__(self, values: list[Any]) -> None:
        self.values = values

    def tolist(self) -> list[Any]:
        return self.values

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i: int) -> Any:
        return self.values[i]


class _FakeScalar:
    def __init__(self, value: float) -> None:
        self.value = value

    def item(self) -> float:
        return self.value


def test_to_native_converts_array_likes_and_scalars_by_duck_typing() -> None:
    value = {"a": _FakeScalar(3), "b": _FakeArray([1.5, _FakeScalar(2.5)]), "c": (1, {2}), 4: b"x"}
    assert to_native(value) == {"a": 3, "b": [1.5, 2.5], "c": [1, [2]], "4": "x"}


def test_to_native_returns_new_containers_so_the_input_is_never_mutated() -> None:
    row = {"tags": ["a"], "meta": {"k": 1}}
    native = to_native(row)
    native["tags"].append("b")
    native["meta"]["k"] = 2
    assert row == {"tags": ["a"], "meta": {"k": 1}}


def test_to_native_rejects_an_unconvertible_object_naming_its_type() -> None:
    with pytest.raises(TypeError, match="object"):
        to_native(object())


def test_batch_rows_reads_a_column_mapping_of_array_likes() -> None:
    batch = {"x": _FakeArray([1, 2]), "y": ["a", "b"]}
    assert batch_rows(batch) == [{"x": 1, "y": "a"}, {"x": 2, "y": "b"}]


def test_batch_rows_rejects_columns_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        batch_rows({"x": [1, 2], "y": [1]})


def test_batch_top_up_splits_and_concatenates_list_columns_across_batches_and_epochs() -> None:
    top_up = BatchTopUp(lambda: [{"l": [0, 1, 2]}, {"l": [3]}])
    assert top_up.next_batch(2) == {"l": [0, 1]}
    assert top_up.next_batch(3) == {"l": [2, 3, 0]}
    assert top_up.epoch == 2


def test_batch_top_up_rejects_an_unsupported_column_type_naming_the_key() -> None:
    top_up = BatchTopUp(lambda: [{"k": (1, 2)}, {"k": (3,)}])
    with pytest.raises(TypeError, match="unsupported batch value type for key 'k'"):
        top_up.next_batch(3)


def test_batch_top_up_refuses_a_non_positive_size() -> None:
    with pytest.raises(ValueError, match="size must be > 0, got 0"):
        BatchTopUp(list).next_batch(0)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("train_rollout_n", 0),
        ("rollout_timeout_seconds", 0.0),
        ("rollout_timeout_seconds", float("inf")),
        ("poll_interval_seconds", -1.0),
        ("max_poll_interval_seconds", 0.5),
        ("max_poll_interval_seconds", float("inf")),
        ("terminal_page_limit", 0),
        ("k8s_job_template_path", "/nonexistent/job.yaml"),
    ],
)
def test_invalid_manager_config_raises_value_error_naming_the_key(key: str, value: Any) -> None:
    with pytest.raises(ValueError, match=key):
        RolloutManagerConfig(**{key: value})


@pytest.mark.parametrize(
    ("elapsed", "n_done", "n_pending", "pause"),
    [
        (0.0, 0, 256, 1.0),  # the first pauses are the poll interval
        (9.0, 0, 256, 3.0),  # then a third of the time waited, while nothing says how long is left
        (30.0, 0, 256, 4.0),  # at most 4x the poll interval by default
        (30.0, 200, 56, 2.8),  # a third of the time left: 56 rollouts at 200 per 30 s
        (50.0, 250, 6, 1.0),  # near the end, the poll interval again
    ],
)
def test_a_sync_waits_pause_stretches_while_the_wave_is_young_and_far_from_done(
    elapsed: float, n_done: int, n_pending: int, pause: float
) -> None:
    clock = _Clock(100.0)
    config = RolloutManagerConfig(poll_interval_seconds=1.0)
    pacer = SweepPacer(config.poll_interval_seconds, config.poll_interval_cap, clock=clock)
    clock.now += elapsed
    assert pacer.pause(n_done, n_pending) == pytest.approx(pause)


def test_a_cap_equal_to_the_poll_interval_sweeps_at_a_fixed_interval() -> None:
    clock = _Clock(100.0)
    config = RolloutManagerConfig(poll_interval_seconds=0.5, max_poll_interval_seconds=0.5)
    pacer = SweepPacer(config.poll_interval_seconds, config.poll_interval_cap, clock=clock)
    clock.now += 60.0
    assert [pacer.pause(0, 10), pacer.pause(5, 5)] == [0.5, 0.5]


def test_rollout_config_carries_timeout_agent_class_and_template_text(tmp_path: Path) -> None:
    template = tmp_path / "job.yaml"
    template.write_text("kind: Job\n")
    config = RolloutManagerConfig(
        rollout_timeout_seconds=90.5,
        local_agent_class="pkg.Agent",
        local_env_map={"A": "1"},
        k8s_job_template_path=str(template),
    )
    wire = config.rollout_config().model_dump(mode="json")
    assert wire == {
        "timeout_seconds": 91,
        "local": {"agent_class": "pkg.Agent", "env_map": {"A": "1"}},
        "k8s": {"job_template": "kind: Job\n"},
    }


@pytest.mark.parametrize("async_size", [None, 3, 2])
def test_async_batch_size_below_train_batch_size_raises_value_error(async_size: int | None) -> None:
    config = RolloutManagerConfig()
    with AglClient("http://127.0.0.1:9") as client, pytest.raises(ValueError, match="async_train_batch_size"):
        AsyncRolloutManager(client, config, train_batch_size=4, async_train_batch_size=async_size)


def test_retry_policy_delays_are_bounded_and_counted() -> None:
    policy = RetryPolicy(max_attempts=6, base_delay_s=0.5, max_delay_s=2.0, jitter=0.25)
    delays = list(policy.delays())
    assert len(delays) == 5
    for delay, base in zip(delays, [0.5, 1.0, 2.0, 2.0, 2.0], strict=True):
        assert base * 0.75 <= delay <= base * 1.25


def test_model_registrations_normalise_bare_addresses_and_carry_the_version() -> None:
    regs = model_registrations("m", ["10.0.0.1:8000", "https://h/v1"], version=7)
    assert [(r.endpoint, r.version) for r in regs] == [("http://10.0.0.1:8000/v1", 7), ("https://h/v1", 7)]


def test_valid_model_requests_become_triplets_and_last_reward_is_set_on_last_triplet() -> None:
    events = [
        _triplet_request([1, 2], [3]),
        _event("reward", {"value": 0.25}),
        _triplet_request([1, 2, 3, 4], [5, 6]),
        _event("reward", {"value": 1}),
    ]
    extraction = extract_triplets(events)
    assert extraction.final_reward == 1.0
    assert [(t.prompt_token_ids, t.response_token_ids, t.reward) for t in extraction.triplets] == [
        ([1, 2], [3], None),
        ([1, 2, 3, 4], [5, 6], 1.0),
    ]
    assert extraction.triplets[0].weight_version == 3
    assert extraction.n_invalid_events == 0


@pytest.mark.parametrize(
    "bad",
    [
        {"status": "error"},
        {"http_status": 500},
        {"error": {"message": "boom"}},
        {"response_token_ids": []},
        {"response_token_ids": [-1]},
        {"response_log_probs": [-0.1, -0.2]},
        {"prompt_token_ids": "not a list"},
    ],
)
def test_invalid_model_request_is_skipped_and_counted(bad: dict[str, Any]) -> None:
    extraction = extract_triplets([_triplet_request([9], [8]), _triplet_request([1], [2], **bad)])
    assert [t.prompt_token_ids for t in extraction.triplets] == [[9]]
    assert extraction.n_invalid_events == 1


@pytest.mark.parametrize("value", [None, "1.0", True, float("nan")])
def test_non_numeric_reward_is_skipped_and_counted_without_hiding_an_earlier_one(value: Any) -> None:
    extraction = extract_triplets([_event("reward", {"value": 0.5}), _event("reward", {"value": value})])
    assert extraction.final_reward == 0.5
    assert extraction.n_invalid_events == 1


def test_empty_prompt_ids_are_kept_as_a_triplet() -> None:
    extraction = extract_triplets([_triplet_request([], [4])])
    assert [t.response_token_ids for t in extraction.triplets] == [[4]]


def test_percentile_interpolates_linearly_like_numpy() -> None:
    values = [1.0, 2.0, 4.0, 10.0]
    expected = {0: 1.0, 50: 3.0, 90: 8.2, 99: 9.82, 100: 10.0}  # numpy.percentile(values, q)
    assert {q: percentile(values, q) for q in expected} == pytest.approx(expected)


def _completed(i: int, enqueue: float, running: float | None, finished: float) -> CompletedRollout:
    return CompletedRollout(
        rollout_id=f"r{i}",
        data_id="d",
        step=0,
        sample_idx_in_step=i,
        enqueue_time=enqueue,
        running_at=running,
        finished_at=finished,
        rollout_state=RolloutState.SUCCEEDED,
    )


def test_lifecycle_metrics_give_queue_run_and_total_percentiles() -> None:
    metrics = lifecycle_metrics(
        [_completed(0, 0.0, 1.0, 3.0), _completed(1, 0.0, 3.0, 7.0), _completed(2, 0.0, None, 5.0)]
    )
    assert metrics["timing/rollout_queue_wait_s/mean"] == 2.0
    assert metrics["timing/rollout_queue_wait_s/max"] == 3.0
    assert metrics["timing/rollout_run_duration_s/p50"] == 3.0
    assert metrics["timing/rollout_total_s/p90"] == pytest.approx(6.6)
    assert metrics["timing/rollout_total_s/p99"] == pytest.approx(6.96)
    assert metrics["timing/rollout_n_missing_running_ts"] == 1.0


def _observed(state: RolloutState, updated_at: float) -> Rollout:
    return Rollout.model_validate(
        {
            "rollout_id": "r",
            "input": None,
            "config": {},
            "status": {"state": state, "created_at": 0.0, "updated_at": updated_at},
        }
    )


def test_a_rollout_never_seen_running_gets_its_terminal_updated_at_as_running_time() -> None:
    record = EnqueuedRollout(rollout_id="r", data_id="d", step=0, sample_idx_in_step=0, enqueue_time=1.0)
    record_lifecycle(record, _observed(RolloutState.QUEUING, 2.0))
    record_lifecycle(record, _observed(RolloutState.SUCCEEDED, 7.5))
    assert (record.running_at, record.finished_at) == (7.5, 7.5)


def test_running_time_is_the_first_running_observation_and_finish_the_terminal_one() -> None:
    record = EnqueuedRollout(rollout_id="r", data_id="d", step=0, sample_idx_in_step=0, enqueue_time=1.0)
    for state, updated_at in [
        (RolloutState.RUNNING, 3.0),
        (RolloutState.RUNNING, 4.0),
        (RolloutState.FAILED, 9.0),
    ]:
        record_lifecycle(record, _observed(state, updated_at))
    assert (record.running_at, record.finished_at) == (3.0, 9.0)


def test_lifecycle_metrics_of_no_rollouts_are_empty() -> None:
    assert lifecycle_metrics([]) == {}


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _progress_state() -> tuple[WaitCounts, dict[str, EnqueuedRollout]]:
    counts = WaitCounts()
    counts.add(_completed(0, 100.0, 102.0, 105.0), 0)
    counts.add(_completed(1, 100.0, 101.0, 102.0).model_copy(update={"timed_out": True}), 0)
    pending = {
        f"p{i}": EnqueuedRollout(
            rollout_id=f"p{i}",
            data_id="d",
            step=0,
            sample_idx_in_step=i,
            enqueue_time=100.0 + i,
            running_at=running,
        )
        for i, running in enumerate([None, 103.0, None])
    }
    return counts, pending


def test_progress_on_a_tty_rewrites_one_line_with_outcomes_queue_and_run_times_and_logs_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stream, clock = _Tty(), _Clock(100.0)
    progress = WaitProgress("train rollouts", 5, stream=stream, clock=clock)
    counts, pending = _progress_state()
    with caplog.at_level(logging.INFO, logger="agl_rollout.progress"):
        clock.now = 112.0
        progress.update(2, counts, pending)
        clock.now = 120.0
        progress.close(5, counts)
    assert caplog.records == []
    assert stream.getvalue() == (
        "\rtrain rollouts: 2/5 done  ok=1 failed=0 timed_out=1  queued=2 running=1 mean_queue_wait=1.5s "
        "mean_run=2.0s oldest_pending=12s  elapsed=12s\x1b[K"
        "\rtrain rollouts: 5/5 done  ok=1 failed=0 timed_out=1  mean_queue_wait=1.5s mean_run=2.0s  "
        "elapsed=20s\x1b[K\n"
    )


def test_progress_off_a_tty_writes_nothing_and_logs_at_most_every_10_s_and_at_the_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stream, clock = io.StringIO(), _Clock(100.0)
    progress = WaitProgress("val rollouts", 5, stream=stream, clock=clock)
    counts, pending = _progress_state()
    with caplog.at_level(logging.INFO, logger="agl_rollout.progress"):
        for now in (105.0, 110.0, 115.0):
            clock.now = now
            progress.update(2, counts, pending)
        clock.now = 116.0
        progress.close(5, counts)
    assert stream.getvalue() == ""
    assert [r.getMessage() for r in caplog.records] == [
        "val rollouts progress done=2 total=5 succeeded=1 failed=0 timed_out=1 queued=2 running=1 "
        "mean_queue_wait=1.5s mean_run=2.0s oldest_pending=10s elapsed_s=10.0",
        "val rollouts progress done=5 total=5 succeeded=1 failed=0 timed_out=1 mean_queue_wait=1.5s "
        "mean_run=2.0s elapsed_s=16.0",
    ]


def test_progress_off_a_tty_says_nothing_of_a_wait_shorter_than_10_s(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stream, clock = io.StringIO(), _Clock(100.0)
    progress = WaitProgress("train rollouts", 5, stream=stream, clock=clock)
    counts, pending = _progress_state()
    with caplog.at_level(logging.INFO, logger="agl_rollout.progress"):
        clock.now = 105.0
        progress.update(2, counts, pending)
        clock.now = 109.0
        progress.close(5, counts)
    assert (stream.getvalue(), caplog.records) == ("", [])


def _hooks_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "hooks.py"
    path.write_text("from agl_rollout import RolloutHooks\n" + body)
    return path


class _RaisingStartup(RolloutHooks):
    def on_startup(self, store: Any | None = None) -> None:
        raise RuntimeError("startup boom")


def test_hook_runner_startup_logs_and_counts_a_raising_on_startup(caplog: pytest.LogCaptureFixture) -> None:
    with AglClient("http://127.0.0.1:9") as client:
        runner = HookRunner(_RaisingStartup(), client)
        with caplog.at_level(logging.ERROR, logger="agl_rollout.hooks"):
            runner.startup()
    assert runner.n_errors == 1
    assert [(r.getMessage(), str(r.exc_info[1]) if r.exc_info else None) for r in caplog.records] == [
        ("rollout hook raised; training continues hook=on_startup rollout_id=None", "startup boom")
    ]


def test_load_hooks_instantiates_the_one_subclass(tmp_path: Path) -> None:
    hooks = load_hooks(_hooks_file(tmp_path, "class Mine(RolloutHooks):\n    marker = 1\n"))
    assert type(hooks).__name__ == "Mine"


def test_load_hooks_without_a_subclass_raises_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="No RolloutHooks subclass found"):
        load_hooks(_hooks_file(tmp_path, "x = 1\n"))


def test_load_hooks_with_two_subclasses_raises_value_error_naming_both(tmp_path: Path) -> None:
    body = "class A(RolloutHooks):\n    pass\nclass B(RolloutHooks):\n    pass\n"
    with pytest.raises(ValueError, match=r"Multiple RolloutHooks subclasses found .*\['A', 'B'\]"):
        load_hooks(_hooks_file(tmp_path, body))


def test_load_hooks_of_a_missing_file_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="Hooks module not found"):
        load_hooks(tmp_path / "nope.py")


def test_request_image_urls_reads_image_parts_in_order_including_json_text_content() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:a"}}
    request = {
        "messages": [
            {"role": "system", "content": "plain text"},
            {"role": "user", "content": [{"type": "text", "text": "x"}, image]},
            {
                "role": "user",
                "content": json.dumps([{"type": "image_url", "image_url": {"url": "file:///b"}}]),
            },
            {"role": "user", "content": [{"type": "image_url", "image_url": "bare-string"}, "not-a-part"]},
            "not-a-message",
        ]
    }
    assert request_image_urls(request) == ["data:a", "file:///b"]
    assert request_image_urls({"prompt": [1, 2]}) == []
    assert request_image_urls(None) == []


def _timed(timestamp: float, urls: list[str], prompt: list[int] | None = None) -> Event:
    """A raw model_request event (its prompt ids in the response) or, with ``urls`` empty and
    ``prompt`` given, the trimmed view of one."""
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    data: dict[str, Any] = {
        "request": {"messages": [{"role": "user", "content": parts}]},
        "response": {"prompt_token_ids": prompt or [1], "choices": [{"token_ids": [2]}]},
    }
    return Event(event_type="model_request", rollout_id="r", attempt_id="0", timestamp=timestamp, data=data)


def _trimmed(timestamp: float, prompt: list[int]) -> Event:
    data = {"prompt_token_ids": prompt, "response_token_ids": [2]}
    return Event(event_type="model_request", rollout_id="r", attempt_id="0", timestamp=timestamp, data=data)


def test_image_urls_pair_each_trimmed_call_with_the_raw_call_of_its_timestamp_and_prompt() -> None:
    raw = [_timed(1.0, ["a"]), _timed(2.0, ["b"], [7]), _timed(2.0, ["c"], [8]), _timed(3.0, [])]
    trimmed = [_trimmed(2.0, [8]), _event("reward", {"value": 1.0}), _trimmed(3.0, [1])]
    assert image_urls_per_call(trimmed, raw) == [["c"], []]


def test_a_trimmed_call_without_a_raw_partner_leaves_the_rollouts_images_out_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    raw = [_timed(1.0, ["a"]), _timed(2.0, ["b"])]
    with caplog.at_level(logging.WARNING, logger="agl_rollout.raw_calls"):
        assert image_urls_per_call([_trimmed(1.0, [1]), _trimmed(9.0, [1])], raw) is None
    assert "rollout r: model call 1 of the triplet view has no raw model_request event" in caplog.text


def _answered_as(model: object) -> Event:
    data = {"response": {"model": model, "choices": [{"token_ids": [2]}]}}
    return Event(event_type="model_request", rollout_id="r", attempt_id="0", timestamp=1.0, data=data)


def test_a_call_answered_by_an_adapter_of_the_prefix_is_at_that_adapters_version() -> None:
    calls = [
        _answered_as(m)
        for m in ("agl-model-v3", "agl-model-v12", "agl-model", "agl-model-v3x", "other-v4", 7)
    ]
    assert served_adapter_versions(calls, "agl-model-v") == [3, 12, None, None, None, None]


def test_extracted_triplets_take_the_served_adapters_version_over_the_registrations() -> None:
    def call(version: int) -> Event:
        data = {
            "prompt_token_ids": [1],
            "response_token_ids": [2],
            "server": {"model": "m", "version": version},
        }
        return _event("model_request", data)

    extraction = extract_triplets([call(5), call(5)], versions=[4, None])
    assert [t.weight_version for t in extraction.triplets] == [4, 5]


def test_the_collectors_admission_is_the_only_formula_for_how_many_groups_to_start() -> None:
    # The async manager holds groups; how many samples to enqueue is GroupCollector's Admission
    # alone (a second formula beside it had no caller and could drift from it).
    second_formula = ("shortfall", "enqueue_and_wait_until_group_completed")
    assert [name for name in second_formula if hasattr(AsyncRolloutManager, name)] == []


def test_a_raw_calls_endpoint_is_the_one_the_gateway_sent_it_to() -> None:
    calls = [
        _event("model_request", {"server": {"model": "m", "endpoint": "http://127.0.0.1:8000/v1"}}),
        _event("model_request", {"server": {"model": "m", "endpoint": 8000}}),
        _event("model_request", {"server": {"model": "m"}}),
        _event("model_request", {}),
    ]
    assert served_endpoints(calls) == ["http://127.0.0.1:8000/v1", None, None, None]


def test_extracted_triplets_carry_each_calls_serving_endpoint_where_known() -> None:
    events = [_triplet_request([1], [2]), _triplet_request([1], [3])]
    extraction = extract_triplets(events, endpoints=["http://127.0.0.1:8001/v1", None])
    assert [t.metadata["server"] for t in extraction.triplets] == [
        {"model": "m", "version": 3, "endpoint": "http://127.0.0.1:8001/v1"},
        {"model": "m", "version": 3, "endpoint": None},  # the triplet view's own: dropped
    ]
