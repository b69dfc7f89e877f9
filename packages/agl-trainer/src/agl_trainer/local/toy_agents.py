"""The toy tasks as agent classes for the real ``agl-controller`` (``runner=controller``).

The controller's local runner starts one Python process per rollout that does
``AgentClass().run()`` with the controller's interpreter and its environment plus ``AGL_KEY``,
``AGL_OPENAI_BASE_URL`` (this rollout's gateway base), ``AGL_EVENT_URL`` (its events) and the
rollout's ``config.local.env_map`` entries. :func:`toy_env_map` is the env map these classes read:
the rollout input as JSON, the model folder whose tokenizer the task uses, and the tool latency.

``run`` plays one rollout of the task through the gateway, posts the reward as a ``reward`` event
and returns; any error propagates, so the process exits non-zero and the controller marks the
rollout failed. Needs only httpx and tokenizers (see :func:`agl_trainer.local.envs.agl_server_spec`).
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import httpx

from agl_trainer.local.agent import AgentContext, GatewayModel
from agl_trainer.local.toy_task import TOY_TASKS, TokenShareTask, ToolLatency

RUNNERS = ("local", "controller")
"""Who runs the embedded default's toy agents: threads in the trainer (:class:`agl_trainer.local.runner.LocalAgentRunner`) or
the real agl-controller, with the agent classes below."""
INPUT_ENV = "AGL_TOY_INPUT"
MODEL_ENV = "AGL_TOY_MODEL"
TOOL_LATENCY_ENV = "AGL_TOY_TOOL_LATENCY"
MODEL_CALL_TIMEOUT_SECONDS = 300.0


def toy_env_map(model_path: Path, tool_latency: ToolLatency | None = None) -> dict[str, str]:
    """The ``agentlightning.local.env_map`` the toy agent classes read: the whole input under
    :data:`INPUT_ENV`, the model folder and the tool latency (``MEDIAN:P99``) as literals."""
    env_map = {INPUT_ENV: "input", MODEL_ENV: str(model_path)}
    if tool_latency is not None:
        env_map[TOOL_LATENCY_ENV] = f"{tool_latency.median}:{tool_latency.p99}"
    return env_map


def _required(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise RuntimeError(
            f"{name} is not set: toy agents run under agl-controller, with config.local.env_map from toy_env_map()"
        )
    return value


class ToyAgent:
    """One rollout of a toy task (:data:`TOY_TASKS` ``[task]``) in an agl-controller worker."""

    task: ClassVar[str]

    def run(self) -> None:
        base_url, event_url, key = (
            _required(name) for name in ("AGL_OPENAI_BASE_URL", "AGL_EVENT_URL", "AGL_KEY")
        )
        build: Callable[[Path], TokenShareTask] = TOY_TASKS[self.task]
        task = build(Path(_required(MODEL_ENV)))
        if latency := os.environ.get(TOOL_LATENCY_ENV):
            # One seed per rollout (its event URL names it): a rerun draws the same latencies.
            task = replace(task, tool_latency=ToolLatency.parse(latency, seed=zlib.crc32(event_url.encode())))
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(headers=headers, timeout=MODEL_CALL_TIMEOUT_SECONDS) as http:
            context = AgentContext(
                rollout_id=event_url.split("/api/rollouts/", 1)[-1].split("/", 1)[0],
                input=json.loads(_required(INPUT_ENV)),
                is_train="/mode/train/" in base_url,
                model=GatewayModel(http, base_url),
            )
            reward = task(context)
            response = http.post(
                event_url, json={"event_type": "reward", "data": {"value": reward, "source": "agent"}}
            )
            response.raise_for_status()


class DigitsAgent(ToyAgent):
    """``task=digits`` under agl-controller: ``agl_trainer.local.toy_agents:DigitsAgent``."""

    task = "digits"


class UpperAgent(ToyAgent):
    """``task=upper`` under agl-controller: ``agl_trainer.local.toy_agents:UpperAgent``."""

    task = "upper"


AGENT_CLASSES: dict[str, str] = {
    "digits": f"{__name__}:DigitsAgent",
    "upper": f"{__name__}:UpperAgent",
}
"""The agent class path of each toy task, for ``agentlightning.local.agent_class``."""
