"""Pushes to N servers: every server at once, and each failure named with its own line."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx

from agl_trainer.serving.errors import UnchangedWeightsError, WeightPushError
from agl_trainer.serving.transfer import on_each, place, push_failed

ENDPOINTS = ["http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1", "http://127.0.0.1:3/v1"]


def test_every_server_is_tried_at_once() -> None:
    # Each job waits until all have started: one after another, the first would wait alone and fail.
    together = threading.Barrier(len(ENDPOINTS), timeout=30)
    results, failures = on_each(ENDPOINTS, lambda endpoint: (together.wait(), endpoint)[1])
    assert results == {endpoint: endpoint for endpoint in ENDPOINTS}
    assert failures == {}


def test_a_server_that_fails_is_named_with_its_one_line_error_after_the_others_finished() -> None:
    finished: list[str] = []

    def job(endpoint: str) -> str:
        if endpoint == ENDPOINTS[1]:
            raise WeightPushError("reload_weights from /s/step_2 failed with HTTP 500:\n  Traceback ...")
        if endpoint == ENDPOINTS[2]:
            raise httpx.ConnectError("[Errno 111] Connection refused")
        finished.append(endpoint)
        return endpoint

    results, failures = on_each(ENDPOINTS, job)
    assert results == {ENDPOINTS[0]: ENDPOINTS[0]}
    assert finished == [ENDPOINTS[0]]
    assert failures == {
        ENDPOINTS[1]: "reload_weights from /s/step_2 failed with HTTP 500: Traceback ...",
        ENDPOINTS[2]: "ConnectError: [Errno 111] Connection refused",
    }


def test_the_error_of_a_partly_failed_push_names_each_failed_server_and_keeps_the_failures() -> None:
    failures = {ENDPOINTS[2]: "ConnectError: [Errno 111] Connection refused"}
    error = push_failed("weights version 3 (/w/step_3)", 3, failures)
    assert type(error) is WeightPushError
    assert str(error) == (
        "weights version 3 (/w/step_3) did not reach 1 of 3 vLLM server(s) "
        "(http://127.0.0.1:3/v1: ConnectError: [Errno 111] Connection refused); "
        "check agentlightning.external_servers.endpoints"
    )
    assert error.failures == failures
    assert type(push_failed("v", 3, failures, unchanged=True)) is UnchangedWeightsError


def test_a_shared_folder_is_read_where_it_is_and_nothing_is_sent(tmp_path: Path) -> None:
    # The endpoints are closed ports: anything sent to them would fail.
    paths, failures = place("shared_folder", ENDPOINTS, "m", tmp_path / "step_1")
    assert paths == {endpoint: str(tmp_path / "step_1") for endpoint in ENDPOINTS}
    assert failures == {}


def test_an_upload_to_a_server_that_is_not_running_is_a_failure_of_that_server(tmp_path: Path) -> None:
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_1" / "config.json").write_text("{}")
    paths, failures = place("upload", ENDPOINTS[:1], "m", tmp_path / "step_1")
    assert paths == {}
    assert list(failures) == ENDPOINTS[:1]
    assert failures[ENDPOINTS[0]].startswith("ConnectError: ")
