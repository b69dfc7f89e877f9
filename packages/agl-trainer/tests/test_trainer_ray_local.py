"""agl_trainer.ray_local: when agl starts its own Ray, and the settings that keep it to this machine."""

from __future__ import annotations

import os
import re

import pytest

from agl_trainer.ray_local import CLUSTER_SWITCH, cluster_address, loopback_only, on_loopback, use_run_token


def test_the_cluster_joined_is_the_address_given_else_ray_address_and_none_starts_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert [cluster_address(None), cluster_address("local"), cluster_address("10.0.0.1:6379")] == [
        None,
        None,
        "10.0.0.1:6379",
    ]
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert [cluster_address(None), cluster_address("10.0.0.1:6379")] == ["10.0.0.2:6379", "10.0.0.1:6379"]
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert cluster_address(None) is None


def test_a_head_on_127_0_0_1_or_localhost_is_on_loopback() -> None:
    addresses = ["127.0.0.1:6379", "localhost:6379", "ray://127.0.0.1:10001", "10.0.0.1:6379", "myhost:6379"]
    assert [on_loopback(address) for address in addresses] == [True, True, True, False, False]


def test_a_run_token_is_a_fresh_256_bit_token_in_the_environment_unless_the_user_set_rays_auth(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    use_run_token()
    assert "RAY_AUTH_MODE" not in os.environ  # ray.init turns it on, for the cluster it starts
    assert re.fullmatch(r"[0-9a-f]{64}", os.environ["RAY_AUTH_TOKEN"])
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    use_run_token()
    assert (os.environ["RAY_AUTH_MODE"], "RAY_AUTH_TOKEN" in os.environ) == ("disabled", False)


def test_loopback_only_turns_rays_cluster_switch_off_inside_and_restores_it_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ray._private import ray_constants

    monkeypatch.setenv(CLUSTER_SWITCH, "1")
    before = ray_constants.ENABLE_RAY_CLUSTER
    with loopback_only():
        assert (os.environ[CLUSTER_SWITCH], ray_constants.ENABLE_RAY_CLUSTER) == ("0", False)
    assert (os.environ[CLUSTER_SWITCH], ray_constants.ENABLE_RAY_CLUSTER) == ("1", before)
