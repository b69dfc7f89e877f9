"""An agent whose every rollout fails: the runs of ``test_trainer_local_own_agent.py`` that train
nothing, imported by agl-controller's workers through ``PYTHONPATH`` as ``my_agents`` is."""

from __future__ import annotations


class FailingAgent:
    """Raises before any model call, so the controller fails its rollout with this error."""

    def run(self) -> None:
        raise RuntimeError("this agent fails on purpose")
