"""Agent classes for the agl-controller tests, imported by the controller's workers (the agl-server
tool environment: stdlib and httpx only). Each reads its rollout's input from ``AGL_TEST_INPUT``
(``env_map={"AGL_TEST_INPUT": "input"}``) and does what ``input["do"]`` says."""

from __future__ import annotations

import json
import os
import sys
import time

import httpx


class ScriptedAgent:
    """``reward``: post ``input["x"]`` as the reward; ``crash``: raise; ``exit3``: exit with code 3;
    ``silent``: exit 0 without a reward; ``hang``: sleep ``input["seconds"]``, then post nothing."""

    def run(self) -> None:
        task = json.loads(os.environ["AGL_TEST_INPUT"])
        action = task["do"]
        if action == "reward":
            response = httpx.post(
                os.environ["AGL_EVENT_URL"],
                headers={"Authorization": f"Bearer {os.environ['AGL_KEY']}"},
                json={"event_type": "reward", "data": {"value": float(task["x"])}},
            )
            response.raise_for_status()
        elif action == "crash":
            raise RuntimeError("the agent crashed on purpose")
        elif action == "exit3":
            sys.exit(3)
        elif action == "hang":
            time.sleep(float(task["seconds"]))
        elif action != "silent":
            raise ValueError(f"unknown action {action!r}")
