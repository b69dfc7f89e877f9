"""One Ray cluster for the whole test session.

``ray.init`` and its shutdown cost about 8 s on a 2-core machine; the modules that start verl's
workers share one cluster instead of paying that each. Sharing is safe only while every module
gives back what it took, so a module that leaves CPUs held (a live actor, a placement group)
fails at its teardown, and the cluster is restarted for the next module.

Ray is imported inside the fixture: this plugin loads in every pass, some without Ray.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

RAY_CPUS = 2
_RELEASE_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """Ray on ``RAY_CPUS`` logical CPUs with agl's CPU runtime env, started on first use and kept
    for the session; the module must release every CPU it took by its end."""
    import ray

    from agl_trainer.verl_glue.workers import ray_runtime_env

    if not ray.is_initialized():
        ray.init(num_cpus=RAY_CPUS, include_dashboard=False, runtime_env=ray_runtime_env("cpu"))
    yield
    if not ray.is_initialized():
        return
    held = _cpus_still_held()
    if held:
        ray.shutdown()
        pytest.fail(
            f"the module left {held:g} of Ray's {RAY_CPUS} CPUs held (a live actor or placement group)"
        )


def _cpus_still_held() -> float:
    """CPUs not yet free after ``_RELEASE_TIMEOUT_S``: killed actors release theirs asynchronously."""
    import ray

    deadline = time.monotonic() + _RELEASE_TIMEOUT_S
    while True:
        held = RAY_CPUS - ray.available_resources().get("CPU", 0.0)
        if held <= 0 or time.monotonic() > deadline:
            return max(held, 0.0)
        time.sleep(0.1)
