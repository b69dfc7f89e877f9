"""Requests per completed rollout and wall time of agl-rollout's sync wait vs one GET per pending rollout.

Drives N rollouts (default 1,000) through a real agl-server on loopback with instant fake
agents, twice in the same run: once with ``SyncRolloutManager`` (terminal-rollouts cursor)
and once with the reference's strategy (every poll GETs every pending rollout). Both poll at
the same interval, fetch the same events (triplet format, no hooks) and count only the
trainer side's HTTP requests.

Then the fault case: the sync wait for 64 samples x 4 (``--fault-samples``), once straight to the
server and once through a proxy that drops 20% of the answers (``--drop``: the server acts, the
client's connection is reset), with the ratio of the two wall times. Goal (issue 17): within 2x,
every rollout still returned exactly once.

    .venv/bin/python benchmarks/bench_rollout.py [--rollouts 1000] [--poll 0.1] [--drop 0.2]
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from agl_rollout import AglClient, RolloutManagerConfig, SyncRolloutManager
from agl_testing.agents import FakeAgents
from agl_testing.agl_server import TEST_KEY, AglServerProcess
from agl_testing.fault_proxy import FaultProxy
from agl_types import RolloutCreate, is_terminal


def run_cursor(url: str, n: int, poll: float, *, group_size: int = 1) -> tuple[int, float]:
    """Wait for ``n`` samples x ``group_size`` rollouts; every one must come back exactly once."""
    with AglClient(url, TEST_KEY) as client:
        config = RolloutManagerConfig(train_rollout_n=group_size, poll_interval_seconds=poll, progress=False)
        started = time.perf_counter()
        result = SyncRolloutManager(client, config).enqueue_and_wait_until_completed(
            [{"x": i} for i in range(n)], is_train=True
        )
        ids = [rollout.rollout_id for rollout in result.completed]
        assert len(ids) == len(set(ids)) == n * group_size, "a rollout was lost or returned twice"
        return client.request_count, time.perf_counter() - started


def run_with_dropped_answers(
    server: AglServerProcess, samples: int, poll: float, drop: float
) -> dict[str, float]:
    """The sync wait (``samples`` x 4) straight and through a proxy dropping ``drop`` of the answers."""
    _, clean = run_cursor(server.url, samples, poll, group_size=4)
    with FaultProxy(server.port) as proxy:
        proxy.inject_fraction("drop_response", drop, seed=0)
        _, faulty = run_cursor(proxy.url, samples, poll, group_size=4)
        dropped = len(proxy.injected)
    return {"clean": clean, "faulty": faulty, "dropped": dropped}


def run_get_per_pending(url: str, n: int, poll: float) -> tuple[int, float]:
    """The reference's loop: GET each pending rollout per sweep; triplet events; delete.

    The reference also fetches raw events for every finished rollout, for its hooks; without
    hooks agl-rollout skips that fetch, so it is left out here too and both runs fetch the
    same events.
    """
    with AglClient(url, TEST_KEY) as client:
        started = time.perf_counter()
        pending = [uuid.uuid4().hex for _ in range(n)]
        client.create_rollouts(
            [RolloutCreate(input={"x": i}, rollout_id=rid) for i, rid in enumerate(pending)]
        )
        done = 0
        while pending:
            still: list[str] = []
            for rid in pending:
                rollout = client.get_rollout(rid).rollout
                if not is_terminal(rollout.state):
                    still.append(rid)
                    continue
                client.get_events(rid, triplet=True)
                client.delete_rollout(rid)
                done += 1
            pending = still
            if pending:
                time.sleep(poll)
        assert done == n
        return client.request_count, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description="agl-rollout sync wait vs one GET per pending rollout")
    parser.add_argument("--rollouts", type=int, default=1000)
    parser.add_argument("--poll", type=float, default=0.1, help="poll interval of both strategies, seconds")
    parser.add_argument(
        "--fault-samples", type=int, default=64, help="samples (x4 rollouts) of the fault case"
    )
    parser.add_argument("--drop", type=float, default=0.2, help="fraction of answers the proxy drops")
    args = parser.parse_args()
    server = AglServerProcess()
    server.start()
    try:
        with FakeAgents(server.url, workers=16, poll_interval_s=0.01):
            results = {
                "terminal cursor (agl-rollout)": run_cursor(server.url, args.rollouts, args.poll),
                "GET per pending (reference)": run_get_per_pending(server.url, args.rollouts, args.poll),
            }
            faults = run_with_dropped_answers(server, args.fault_samples, args.poll, args.drop)
    finally:
        server.stop()
    print(f"{args.rollouts} rollouts, instant agents, poll interval {args.poll} s")
    print(f"{'strategy':32s} {'requests':>9s} {'req/rollout':>12s} {'wall s':>8s}")
    for name, (requests, wall) in results.items():
        print(f"{name:32s} {requests:9d} {requests / args.rollouts:12.2f} {wall:8.2f}")
    (ours_req, ours_wall), (ref_req, ref_wall) = results.values()
    print(f"ratio reference/ours: requests x{ref_req / ours_req:.2f}, wall time x{ref_wall / ours_wall:.2f}")
    n = args.fault_samples * 4
    print(
        f"sync wait for {n} rollouts: {faults['clean']:.2f} s clean, {faults['faulty']:.2f} s with {args.drop:.0%} "
        f"of answers dropped ({faults['dropped']:.0f} drops), x{faults['faulty'] / faults['clean']:.2f} "
        "(goal: within x2; every rollout returned exactly once)"
    )


if __name__ == "__main__":
    main()
