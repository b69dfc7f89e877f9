"""An invalid config fails ``run_ppo`` before any rollout is spent: the real agl-server, reached
through a logging FaultProxy (it injects nothing), receives no request at all."""

from __future__ import annotations

import re

import pytest
import ray

from agl_testing.agl_server import TEST_KEY, AglServerProcess
from agl_testing.fault_proxy import FaultProxy
from agl_trainer import run_ppo
from agl_trainer.assembly import compose_config

pytestmark = [pytest.mark.verl, pytest.mark.server]


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (
            ["agentlightning.async_rollout.enabled=true"],
            "agentlightning.async_rollout.async_train_batch_size",
        ),
        (["algorithm.adv_estimator=remax"], "algorithm.adv_estimator=remax"),
        (["agentlightning.trace_aggregator.level=episode"], "agentlightning.trace_aggregator.level"),
    ],
)
def test_an_invalid_config_fails_before_any_rollout_is_created(
    agl_server: AglServerProcess, overrides: list[str], key: str
) -> None:
    ray_was_up = ray.is_initialized()
    with FaultProxy(agl_server.port) as proxy:
        config = compose_config(
            [
                f"agentlightning.agl_base_url={proxy.url}",
                f"agentlightning.agl_key={TEST_KEY}",
                "agentlightning.external_servers.endpoints=[http://127.0.0.1:9/v1]",
                *overrides,
            ]
        )
        with pytest.raises(ValueError, match=re.escape(key)):
            run_ppo(config, [{"x": 0}, {"x": 1}], [{"x": 2}])
        sent = list(proxy.requests)
    assert sent == []  # not even a listing: the server never heard of this run
    assert agl_server.rollout_ids() == []
    assert ray.is_initialized() == ray_was_up  # nor was a cluster started for it
