#!/usr/bin/env bash
# Two training steps on one NVIDIA GPU through verl's own vLLM replicas (the trainer's path 1):
# the embedded default's toy task and tiny model, agl-server and local agents as on CPU, but
# generation by verl's hybrid-engine vLLM, slept during each update and woken with new weights.
#
# Not part of CI (CI has no GPU). Needs PyPI access for the GPU stack (a few GB, the slow part on
# a cold cache); the run itself takes a few minutes. Extra arguments are Hydra overrides.
#
#     bash scripts/gpu-smoke.sh
#     bash scripts/gpu-smoke.sh trainer.total_training_steps=4
set -euo pipefail
cd "$(dirname "$0")/.."

command -v nvidia-smi >/dev/null || { echo "gpu-smoke: no nvidia-smi; this check needs an NVIDIA GPU" >&2; exit 2; }
nvidia-smi -L
command -v uv >/dev/null || python3 -m pip install --quiet uv

export AGL_CACHE_DIR="${AGL_CACHE_DIR:-$HOME/.cache/agl}"
venv="${AGL_GPU_VENV:-$AGL_CACHE_DIR/envs/gpu-smoke}"
# The CPU machines' torch find-links must not leak into the GPU environment.
unset UV_FIND_LINKS

echo "==> GPU environment in $venv"
uv venv --quiet --allow-existing --python 3.11 "$venv"
# verl's vllm extra pins the GPU stack verl 0.9.1 is tested with (torch 2.11, vLLM 0.24,
# transformers 5.9); cachetools, uvicorn and fastapi are imported by verl's trainer but undeclared.
VIRTUAL_ENV="$venv" uv pip install --quiet "verl[vllm]==0.9.1" cachetools uvicorn fastapi \
    -e packages/agl-types -e packages/agl-rollout -e packages/agl-adapter -e packages/agl-algos \
    -e packages/agl-trainer

echo "==> two steps through verl's vLLM replicas"
started=$(date +%s)
"$venv/bin/agl-trainer" trainer.device=cuda trainer.total_training_steps=2 "$@"

run_dir=$(ls -td "$AGL_CACHE_DIR"/runs/*/ | head -1)
"$venv/bin/python" - "$run_dir/metrics.jsonl" "$started" <<'PY'
import json
import sys
import time

rows = [json.loads(line) for line in open(sys.argv[1])]
steps = [row for row in rows if "training/weight_version" in row.get("data", row)]
for row in steps:
    data = row.get("data", row)
    print(
        f"step {row.get('step')}: reward {data.get('training/reward')}, "
        f"pg_loss {data.get('actor/pg_loss')}, weight_version {data.get('training/weight_version')}, "
        f"step time {data.get('timing_s/step')} s"
    )
print(f"gpu-smoke: {len(steps)} steps in {time.time() - float(sys.argv[2]):.0f} s")
sys.exit(0 if len(steps) >= 2 else 1)
PY
