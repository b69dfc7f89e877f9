"""The ``agl-trainer`` console script.

With no arguments it runs the embedded default (see :mod:`agl_trainer.demo`). With Hydra overrides
(``key=value`` as verl users type them) it runs the embedded default's local stack with them
applied; ``--help`` prints this.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: agl-trainer [KEY=VALUE ...]

Trains an LLM agent with GRPO on verl. With no arguments: the embedded default, a complete local
training on CPU (agl-server, a CPU vLLM server, local agents for a toy multi-turn task, verl's FSDP
workers). KEY=VALUE are Hydra overrides of agl-trainer's config (verl's ppo_trainer plus
agentlightning.*), e.g.  agl-trainer trainer.total_training_steps=5 agentlightning.trace_aggregator.level=transition
"""


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in args):
        print(USAGE)
        return
    bad = [arg for arg in args if "=" not in arg]
    if bad:
        raise SystemExit(f"agl-trainer: expected KEY=VALUE overrides, got {bad}\n\n{USAGE}")
    from agl_trainer.demo import run_embedded_default

    run_embedded_default(args)
