"""Load through the real agl-controller: server requests per rollout and the trainer's memory.

Starts agl-server and ``agl-controller runner_type=local`` (both from the agl-server tool
environment) and sends ``--waves`` waves of ``--rollouts`` rollouts (default 3 x 256) through
agl-rollout's sync wait, each rollout's agent a fresh process that posts a reward
(``packages/agl-trainer/tests/controller_agents``). Per wave it prints the trainer side's HTTP
requests per rollout (and per kind of request), the wall time and this process's resident memory.
In the same run, one wave sweeps at a fixed interval (``max_poll_interval_seconds`` = the poll
interval: what the wait's stretched pauses save and cost), and one
wave goes through the reference's strategy (every poll GETs every pending rollout) as the
baseline, with the ratio. Goals (issue 17): <= 2.2 requests per rollout; memory flat across waves.

    .venv/bin/python benchmarks/bench_controller.py [--rollouts 256] [--waves 3] [--slots 64] [--poll 1.0]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from agl_rollout import AglClient, RolloutManagerConfig, SyncRolloutManager
from agl_trainer.local import (
    AglServer,
    agl_server_spec,
    ensure_tool_env,
    start_agl_server,
    start_controller,
)
from agl_types import RolloutConfig, RolloutCreate, RolloutLocalConfig, is_terminal

AGENTS = Path(__file__).resolve().parents[1] / "packages" / "agl-trainer" / "tests" / "controller_agents"
AGENT_CLASS = "agl_scripted_agents:ScriptedAgent"
ENV_MAP = {"AGL_TEST_INPUT": "input"}
GOAL_REQUESTS_PER_ROLLOUT = 2.2


class CountingClient(AglClient):
    """An AglClient that also counts its calls by kind (a retried call counts once here)."""

    def __init__(self, base_url: str, key: str) -> None:
        super().__init__(base_url, key)
        self.by_kind: Counter[str] = Counter()

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        self.by_kind[request_kind(method, path)] += 1
        return super()._send(method, path, **kwargs)


def request_kind(method: str, path: str) -> str:
    """``GET /api/rollouts/{id}/events``-style: the route, the rollout id replaced."""
    parts = path.split("?")[0].split("/")
    if len(parts) > 3 and parts[3] not in ("", "terminal"):
        parts[3] = "{id}"
    return f"{method} {'/'.join(parts)}"


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def rows(n: int) -> list[dict[str, object]]:
    return [{"do": "reward", "x": i / n} for i in range(n)]


def wave_with_cursor(
    server: AglServer, n: int, poll: float, max_poll: float | None = None
) -> tuple[int, float, Counter[str]]:
    """One sync wait of ``n`` rollouts; every one must come back once, succeeded."""
    config = RolloutManagerConfig(
        poll_interval_seconds=poll,
        max_poll_interval_seconds=max_poll,
        rollout_timeout_seconds=600,
        local_agent_class=AGENT_CLASS,
        local_env_map=ENV_MAP,
        progress=False,
    )
    with CountingClient(server.url, server.key) as client:
        started = time.perf_counter()
        result = SyncRolloutManager(client, config).enqueue_and_wait_until_completed(rows(n), is_train=True)
        wall = time.perf_counter() - started
        ids = {rollout.rollout_id for rollout in result.completed}
        assert len(ids) == len(result.completed) == n, "a rollout was lost or returned twice"
        assert all(rollout.succeeded for rollout in result.completed), "an agent failed"
        return client.request_count, wall, client.by_kind


def wave_with_get_per_pending(server: AglServer, n: int, poll: float) -> tuple[int, float]:
    """The reference's loop for the same wave: GET each pending rollout per sweep; events; delete."""
    config = RolloutConfig(
        timeout_seconds=600, local=RolloutLocalConfig(agent_class=AGENT_CLASS, env_map=ENV_MAP)
    )
    with AglClient(server.url, server.key) as client:
        started = time.perf_counter()
        pending = [uuid.uuid4().hex for _ in range(n)]
        client.create_rollouts(
            [
                RolloutCreate(input=row, rollout_id=rid, config=config)
                for row, rid in zip(rows(n), pending, strict=True)
            ]
        )
        while pending:
            still: list[str] = []
            for rid in pending:
                if not is_terminal(client.get_rollout(rid).rollout.state):
                    still.append(rid)
                    continue
                client.get_events(rid, triplet=True)
                client.delete_rollout(rid)
            pending = still
            if pending:
                time.sleep(poll)
        return client.request_count, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=256, help="rollouts per wave, all enqueued at once")
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument("--slots", type=int, default=64, help="the controller's local_runner.maximum_size")
    parser.add_argument(
        "--poll", type=float, default=1.0, help="the trainer's poll interval (its default: 1 s)"
    )
    args = parser.parse_args()
    python = ensure_tool_env(agl_server_spec()).python
    with tempfile.TemporaryDirectory(prefix="agl-bench-controller-") as scratch:
        work = Path(scratch)
        with (
            start_agl_server(python, work / "server") as server,
            start_controller(
                python, server, work / "controller", maximum_size=args.slots, python_path=[AGENTS]
            ),
        ):
            print(
                f"{args.rollouts} rollouts per wave, agl-controller with {args.slots} slots (0.2 s tick), "
                f"trainer poll {args.poll} s"
            )
            print(f"{'wave':>26s} {'requests':>9s} {'req/rollout':>12s} {'wall s':>8s} {'RSS MiB':>8s}")
            ours: list[float] = []
            for wave in range(1, args.waves + 1):
                requests, wall, kinds = wave_with_cursor(server, args.rollouts, args.poll)
                ours.append(requests / args.rollouts)
                print(
                    f"{f'{wave} (agl-rollout)':>26s} {requests:9d} {ours[-1]:12.2f} {wall:8.1f} {rss_mib():8.1f}"
                )
                print("      " + ", ".join(f"{kind} {count}" for kind, count in sorted(kinds.items())))
            fixed_requests, fixed_wall, _ = wave_with_cursor(server, args.rollouts, args.poll, args.poll)
            print(
                f"{'fixed-interval sweeps':>26s} {fixed_requests:9d} {fixed_requests / args.rollouts:12.2f} "
                f"{fixed_wall:8.1f} {rss_mib():8.1f}"
            )
            ref_requests, ref_wall = wave_with_get_per_pending(server, args.rollouts, args.poll)
            print(
                f"{'GET per pending (reference)':>26s} {ref_requests:9d} {ref_requests / args.rollouts:12.2f} "
                f"{ref_wall:8.1f} {rss_mib():8.1f}"
            )
    worst = max(ours)
    verdict = "ok" if worst <= GOAL_REQUESTS_PER_ROLLOUT else "FAIL"
    print(
        f"requests per rollout: at most {worst:.2f} (goal <= {GOAL_REQUESTS_PER_ROLLOUT}: {verdict}); "
        f"reference/ours x{ref_requests / args.rollouts / worst:.2f}"
    )


if __name__ == "__main__":
    main()
