"""agl_algos imports torch and numpy only: verl, ray and httpx stay out until agl_algos.verl is imported."""

from __future__ import annotations

import subprocess
import sys


def test_importing_agl_algos_loads_no_verl_ray_or_httpx() -> None:
    code = "import sys, agl_algos; print(sorted(m for m in ('verl', 'ray', 'httpx', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
