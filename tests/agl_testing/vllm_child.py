"""Probes of the embedded vLLM child module (:mod:`agl_vllm_server`), run in a child interpreter."""

from __future__ import annotations

IMPORT_AS_SPAWN_DOES = "import runpy; runpy.run_module('agl_vllm_server', run_name='__mp_main__')"
"""What spawn does in each child of a ``-m agl_vllm_server`` parent: import it as ``__mp_main__``."""

BUSY_WAIT_DEFAULTS_PROBE = (
    f"{IMPORT_AS_SPAWN_DOES}; "
    "from vllm.distributed.device_communicators.shm_broadcast import SpinCondition; "
    "print(SpinCondition.__init__.__defaults__)"
)
"""Prints ``SpinCondition.__init__``'s defaults as that child sees them."""
