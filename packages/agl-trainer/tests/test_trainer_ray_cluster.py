"""``agl-trainer`` joins a Ray cluster it did not start, and verl places its workers across the nodes.

The test starts two Ray nodes on this machine's loopback (``ray.cluster_utils.Cluster``, 1 CPU
each: the head and one more), runs the real ``agl-trainer steps=3 trainer.nnodes=2`` with
``RAY_ADDRESS`` set to the head, as docs/cluster.md says, and reads from the cluster's GCS on which
node each of verl's worker actors ran. Several machines and GPUs are on paper only (docs/cluster.md).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agl_testing.trainer_command import start_trainer
from agl_trainer.local import RunTotals

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.verl]

NODE_CPUS = 1
"""One CPU a node: verl's two one-CPU worker groups cannot share a node, so each lands on its own."""


@pytest.fixture
def two_nodes() -> Iterator[Any]:
    """A head and a second node, both on 127.0.0.1, torn down however the test ends."""
    from ray.cluster_utils import Cluster

    from agl_trainer.ray_local import LOOPBACK, loopback_only

    cluster = Cluster()
    try:
        with loopback_only():  # the nodes' processes listen on 127.0.0.1, not the machine's address
            for _ in range(2):
                cluster.add_node(num_cpus=NODE_CPUS, node_ip_address=LOOPBACK, include_dashboard=False)
        yield cluster
    finally:
        cluster.shutdown()


@pytest.mark.timeout(1200)
def test_the_embedded_default_trains_3_steps_on_a_two_node_cluster_with_a_worker_on_each_node(
    two_nodes: Any, tmp_path: Path
) -> None:
    run = start_trainer(tmp_path, ("steps=3", "trainer.nnodes=2"), env={"RAY_ADDRESS": two_nodes.address})
    try:
        code = run.wait(900)
    finally:
        if run.process.poll() is None:
            os.killpg(run.process.pid, signal.SIGKILL)
    assert code == 0, run.stderr.read_text()[-3000:]
    assert RunTotals.read(run.run_dir / "metrics.jsonl").steps == 3
    nodes = {node["NodeID"] for node in two_nodes.global_state.node_table()}
    workers = [
        actor["Address"]["NodeID"]
        for actor in two_nodes.global_state.actor_table(None).values()
        if actor["ActorClassName"].endswith("WorkerDict")
    ]
    assert len(nodes) == 2
    assert sorted(workers) == sorted(nodes)
