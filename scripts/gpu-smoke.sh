#!/usr/bin/env bash
# The README's hybrid production command on one NVIDIA GPU: `agl-trainer` with a model, a gateway and
# data files and no external_servers keys, so verl starts its own vLLM replicas (the trainer's path 1).
#
# It verifies what the README promises and CPU tests cannot reach (vLLM itself needs a GPU):
#   - that command's shape composes, validates and starts verl's replicas with agl's defaults
#     (rollout.name, tensor_model_parallel_size=1, micro-batch sizes, processed_logprobs);
#   - agents reach the replicas through the gateway under a served_model_name that is not the
#     model path (every call would be a 404 otherwise);
#   - two steps train, sleeping the replicas for each update and waking them with new weights;
#   - the run ends with no process of it left on the GPU (replica servers, engines, workers).
# It starts what a production run expects to exist: agl-server, local agents for the toy task
# (the embedded default's), a tiny model built offline and JSONL data files.
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

echo "==> the README's hybrid production command, two steps"
"$venv/bin/python" - "$@" <<'PY'
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from agl_trainer.local import (
    TOY_TASKS,
    AglServerApi,
    LocalAgentRunner,
    agl_server_spec,
    cache_dir,
    ensure_tool_env,
    start_agl_server,
)
from agl_trainer.local.demo import build_embedded_model

SERVED = "smoke-policy"  # deliberately not the model path
run = cache_dir() / "runs" / f"gpu-smoke-{time.strftime('%Y%m%d-%H%M%S')}"
run.mkdir(parents=True)
model = build_embedded_model()
task = TOY_TASKS["digits"](model)
for name, n in (("train", 64), ("test", 4)):
    (run / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in task.samples(n)))
metrics = run / "metrics.jsonl"
server_env = ensure_tool_env(agl_server_spec())
started = time.time()
with start_agl_server(server_env.python, run, model_name=SERVED) as server, LocalAgentRunner(
    AglServerApi(server.url, server.key), task
):
    command = [
        str(Path(sys.executable).parent / "agl-trainer"),
        # The README's command, with this machine's values ...
        f"actor_rollout_ref.model.path={model}",
        f"agentlightning.agl_base_url={server.url}",
        f"data.train_files={run / 'train.jsonl'}",
        f"data.val_files={run / 'test.jsonl'}",
        "trainer.n_gpus_per_node=1",
        # ... the gateway's key and model name, and a toy-sized run.
        f"agentlightning.agl_key={server.key}",
        f"agentlightning.served_model_name={SERVED}",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "data.max_response_length=64",
        "agentlightning.trace_aggregator.trajectory_max_prompt_length=64",
        "agentlightning.trace_aggregator.trajectory_max_response_length=64",
        "agentlightning.poll_interval_seconds=0.1",
        "agentlightning.rollout_timeout_seconds=300",
        # sdpa and padded batches, so this check needs no flash-attn build.
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        "trainer.total_training_steps=2",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[console,file]",
        f"trainer.default_local_dir={run / 'checkpoints'}",
        *sys.argv[1:],
    ]
    subprocess.run(command, check=True, env={**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics)})

rows = [json.loads(line) for line in metrics.read_text().splitlines()]
steps = [row for row in rows if "training/weight_version" in row.get("data", row)]
for row in steps:
    data = row.get("data", row)
    print(
        f"step {row.get('step')}: reward {data.get('training/reward')}, pg_loss {data.get('actor/pg_loss')}, "
        f"weight_version {data.get('training/weight_version')}, step time {data.get('timing_s/step')} s"
    )
print(f"gpu-smoke: {len(steps)} steps in {time.time() - started:.0f} s; run folder {run}")
sys.exit(0 if len(steps) >= 2 else 1)
PY

# Teardown: nothing the run started may still hold the GPU.
left=$(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader)
if [ -n "$left" ]; then
    echo "gpu-smoke: processes left on the GPU after the run:" >&2
    echo "$left" >&2
    exit 1
fi
echo "gpu-smoke: passed (no process left on the GPU)"
