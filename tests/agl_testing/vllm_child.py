"""Probes of the embedded vLLM child module (:mod:`agl_vllm_server`), run in a child interpreter."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

IMPORT_AS_SPAWN_DOES = "import runpy; runpy.run_module('agl_vllm_server', run_name='__mp_main__')"
"""What spawn does in each child of a ``-m agl_vllm_server`` parent: import it as ``__mp_main__``."""

BUSY_WAIT_DEFAULTS_PROBE = (
    f"{IMPORT_AS_SPAWN_DOES}; "
    "from vllm.distributed.device_communicators.shm_broadcast import SpinCondition; "
    "print(SpinCondition.__init__.__defaults__)"
)
"""Prints ``SpinCondition.__init__``'s defaults as that child sees them."""


def vllm_child_module(name: str) -> ModuleType:
    """The module ``name`` of the vLLM child folder, imported as vLLM's server imports it: that
    folder on ``sys.path`` (its modules import each other by their plain names)."""
    from agl_trainer.local.services import VLLM_CHILD_PATH

    if str(VLLM_CHILD_PATH) not in sys.path:
        sys.path.insert(0, str(VLLM_CHILD_PATH))
    return importlib.import_module(name)
