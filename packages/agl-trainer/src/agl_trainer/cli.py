"""The ``agl-trainer`` console script.

With no arguments it runs the embedded default (see :mod:`agl_trainer.local.demo`). Hydra overrides
(``key=value`` as verl users type them) and a few shortcuts for newcomers (``task=``, ``steps=``,
``level=``, ``--async``) change it. Naming an agl-server, external inference servers or a model
(:data:`PRODUCTION_KEYS`) makes it the production run instead: nothing local is started and the
rows come from ``data.train_files``/``data.val_files`` (:func:`agl_trainer.assembly.run_from_files`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from agl_trainer.interrupts import hear_ctrl_c
from agl_trainer.terminal import quiet_terminal, terminal

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from agl_trainer.local.toy_task import ToolLatency

PRODUCTION_KEYS = (
    "agentlightning.agl_base_url",
    "agentlightning.external_servers.endpoints",
    "actor_rollout_ref.model.path",
)
"""Overrides that select the production run: any of them means "use my server / servers / model"."""

AGL_LOGGERS = ("agl_rollout", "agl_adapter", "agl_algos", "agl_trainer")

# The embedded default's choices, copied from agl_trainer.local (a test keeps them equal) so that
# parsing a production run's command line loads nothing of the local stack.
TOY_TASK_NAMES = ("digits", "upper")
"""The names of :data:`agl_trainer.local.TOY_TASKS`."""
RUNNERS = ("local", "controller")
""":data:`agl_trainer.local.RUNNERS`."""
DEFAULT_CONTROLLER_RESTARTS = 3
""":data:`agl_trainer.local.DEFAULT_CONTROLLER_RESTARTS`."""

_SHORT_KEYS = {
    "task": "--task",
    "steps": "--steps",
    "level": "--level",
    "mode": "--mode",
    "max_staleness": "--max-staleness",
    "tool_latency": "--tool-latency",
    "runner": "--runner",
    "controller_restarts": "--controller-restarts",
}

_DESCRIPTION = """\
Trains an LLM agent with GRPO on verl.

With no arguments: the embedded default, a complete local training on CPU (agl-server, a CPU vLLM
server, local agents for a toy multi-turn task, verl's FSDP workers) that finishes in minutes on
2 cores, then writes metrics.jsonl and a PNG of reward, step time and (fully async) staleness.

With any of actor_rollout_ref.model.path=, agentlightning.agl_base_url= or
agentlightning.external_servers.endpoints=[...]: the production run. Nothing local is started;
agents run wherever your agl-server sends them, and the training and validation rows are read from
data.train_files and data.val_files (JSONL, or parquet with pyarrow installed).
"""

_EPILOG = """\
KEY=VALUE are Hydra overrides of agl-trainer's config (verl's ppo_trainer plus agentlightning.*);
they are applied after the shortcuts, so a full key wins. Shortcuts:
  task=NAME            same as --task
  steps=N              same as --steps       (trainer.total_training_steps=N)
  level=LEVEL          same as --level       (agentlightning.trace_aggregator.level=LEVEL)
  mode=sync|async|fully-async
                       same as --sync/--async/--fully-async (agentlightning.async_rollout.enabled,
                       agentlightning.fully_async.enabled; the actor recomputes the old
                       log-probs and each token is weighted by min(pi_prox/pi_behaviour, 2):
                       decoupled PPO, fully_async.behaviour_weight_cap)
  max_staleness=K      same as --max-staleness (agentlightning.fully_async.max_staleness; 0 = on-policy)
  tool_latency=M:P99   same as --tool-latency: each toy-task tool call waits a lognormal time with
                       median M and 99th percentile P99 seconds (embedded default only; off by default)
  runner=local|controller
                       same as --runner: who runs the embedded default's agents — threads in the
                       trainer (local, the default) or the real agl-controller, one process each
  controller_restarts=N
                       same as --controller-restarts: how often the embedded default restarts an
                       agl-controller that died (default 3); one more death stops the run
Your own agent on the embedded default: PYTHONPATH=<its folder> agl-trainer runner=controller
  agentlightning.local.agent_class=MODULE:CLASS +agentlightning.local.env_map.NAME=input.FIELD
Logging: trainer.logger=[wandb] adds Weights & Biases (after `wandb login`); the embedded default
always keeps the file logger too, for metrics.jsonl, the plot and its one line per step
(trainer.logger=[console] prints verl's full metrics line instead).

examples:
  agl-trainer steps=5 --async level=transition
  agl-trainer --fully-async max_staleness=1 tool_latency=0.5:6
  agl-trainer task=upper steps=10
  agl-trainer runner=controller
  agl-trainer trainer.logger=[wandb] trainer.project_name=agl-demo
  agl-trainer actor_rollout_ref.model.path=Qwen/Qwen2.5-1.5B-Instruct \\
      agentlightning.agl_base_url=http://gateway:8080 \\
      data.train_files=train.parquet data.val_files=test.parquet trainer.n_gpus_per_node=8
"""


@dataclass(frozen=True)
class CliArgs:
    """What the command line asks for: a toy task (None: not named) and Hydra overrides."""

    task: str | None
    overrides: tuple[str, ...]
    tool_latency: ToolLatency | None = None
    runner: str | None = None
    controller_restarts: int | None = None

    @property
    def is_production(self) -> bool:
        """Whether an override names a real server, servers or model (:data:`PRODUCTION_KEYS`)."""
        return any(override.split("=", 1)[0].lstrip("+~") in PRODUCTION_KEYS for override in self.overrides)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agl-trainer",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--task",
        choices=TOY_TASK_NAMES,
        help="the embedded default's toy task: digits (write digit tokens, the default) or upper (capitals)",
    )
    parser.add_argument("--steps", type=_positive_int, help="training steps (trainer.total_training_steps)")
    parser.add_argument(
        "--level",
        choices=("transition", "trajectory"),
        help="training rows per LLM call (transition) or per merged multi-turn trace (trajectory, the default)",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--mode", choices=("sync", "async", "fully-async"), help="same as --sync / --async / --fully-async"
    )
    mode.add_argument(
        "--async", dest="mode", action="store_const", const="async", help="async rollouts by GRPO group"
    )
    mode.add_argument(
        "--fully-async",
        dest="mode",
        action="store_const",
        const="fully-async",
        help="agents keep running while the actor updates (staleness-bounded; needs external servers)",
    )
    mode.add_argument(
        "--sync", dest="mode", action="store_const", const="sync", help="sync rollouts (the default)"
    )
    parser.add_argument(
        "--max-staleness",
        type=_non_negative_int,
        help="fully-async: train no group more than K weight versions old (0 = on-policy)",
    )
    parser.add_argument(
        "--tool-latency",
        type=_tool_latency,
        metavar="MEDIAN:P99",
        help="toy tasks: lognormal seconds per tool call, e.g. 0.5:6 (embedded default only)",
    )
    parser.add_argument(
        "--runner",
        choices=RUNNERS,
        help="who runs the embedded default's agents: threads in the trainer (local, the default) or the "
        "real agl-controller (controller), one process per rollout",
    )
    parser.add_argument(
        "--controller-restarts",
        type=_non_negative_int,
        metavar="N",
        help=f"runner=controller: restart a dead agl-controller at most N times (default {DEFAULT_CONTROLLER_RESTARTS})",
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides")
    return parser


def parse_args(argv: Sequence[str]) -> CliArgs:
    """Shortcuts and ``KEY=VALUE`` overrides → :class:`CliArgs`; exits with usage on a bad argument."""
    parser = build_parser()
    args = parser.parse_intermixed_args([flag for arg in argv for flag in _expand_short_key(arg)])
    bad = [arg for arg in args.overrides if "=" not in arg]
    if bad:
        parser.error(f"expected KEY=VALUE overrides, got {bad}")
    overrides: list[str] = []
    if args.steps is not None:
        overrides.append(f"trainer.total_training_steps={args.steps}")
    if args.level is not None:
        overrides.append(f"agentlightning.trace_aggregator.level={args.level}")
    if args.mode is not None:
        overrides.append(f"agentlightning.async_rollout.enabled={str(args.mode == 'async').lower()}")
        overrides.append(f"agentlightning.fully_async.enabled={str(args.mode == 'fully-async').lower()}")
    if args.max_staleness is not None:
        overrides.append(f"agentlightning.fully_async.max_staleness={args.max_staleness}")
    return CliArgs(
        task=args.task,
        overrides=(*overrides, *args.overrides),
        tool_latency=args.tool_latency,
        runner=args.runner,
        controller_restarts=args.controller_restarts,
    )


def _expand_short_key(arg: str) -> list[str]:
    key, sep, value = arg.partition("=")
    if sep and key in _SHORT_KEYS:
        return [_SHORT_KEYS[key], value]
    return [arg]


def _tool_latency(text: str) -> ToolLatency:
    from agl_trainer.local.toy_task import ToolLatency  # only the embedded default takes one

    try:
        return ToolLatency.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class _AboveProgressBar(logging.Handler):
    """Writes each line to ``stream`` (None: the terminal's stderr, :func:`agl_trainer.terminal.terminal`)
    above the trainer's progress bar while one is drawn, plainly otherwise: tqdm clears the bar,
    writes, and draws it again (a plain write would run on from the bar)."""

    def __init__(self, stream: TextIO | None) -> None:
        super().__init__()
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream or terminal().err)
        except Exception:  # logging's contract: report, never raise
            self.handleError(record)


def configure_logging(stream: TextIO | None = None) -> logging.Handler:
    """Show agl's INFO lines (progress of long rollout waits, per-step notes) on ``stream`` (None:
    the terminal's stderr, also while the embedded default sends other output to its log), above
    the trainer's progress bar.

    The handler goes on agl's loggers only, which stop propagating (verl installs a root handler,
    so agl's lines would show twice); other libraries keep their own handlers and levels, so
    httpx's per-request INFO lines stay quiet. Returns the handler.
    """
    handler = _AboveProgressBar(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    for name in AGL_LOGGERS:
        agl_logger = logging.getLogger(name)
        agl_logger.setLevel(logging.INFO)
        agl_logger.addHandler(handler)
        agl_logger.propagate = False
    return handler


def main(argv: Sequence[str] | None = None) -> None:
    """Run what the command line asks for. A configuration error (also one of verl's checks failing
    in a Ray worker, agl's state lying in another step's checkpoint, or a server agl cannot train
    with) is one line and exit code 2, a
    process of the embedded default that failed, or ``agentlightning.max_empty_steps`` steps that
    trained nothing, one line and exit code 1, Ctrl-C one line and 130 (heard however the command was
    started: :mod:`agl_trainer.interrupts`); any other error is a bug and keeps its traceback."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    hear_ctrl_c()  # also when started in the background of a script, which hands SIGINT ignored
    _refuse_embedded_options_in_production(args)
    configure_logging()
    try:
        # The embedded default's terminal shows agl's lines, the progress bar and errors; verl's,
        # Ray's and torch's output goes to the run folder's log (production runs keep it all).
        with nullcontext() if args.is_production else quiet_terminal():
            if os.environ.get("VERL_PLATFORM") == "cpu":
                # Started from a process in agl's CPU mode (which exports the choice): verl reads the
                # platform while its engine is imported, so agl's CPU platform must be registered first.
                from agl_trainer.verl_glue.cpu_device import enable_cpu_platform

                enable_cpu_platform()
            _run(args)
    except KeyboardInterrupt as interrupt:
        # run_ppo has stopped its workers and replicas, the embedded default its processes.
        print(interrupted_line(interrupt), file=sys.stderr, flush=True)
        raise SystemExit(130) from None


def _run(args: CliArgs) -> None:
    from agl_trainer.errors import CheckpointStateMismatch, ServerSetupError, TooManyEmptySteps
    from agl_trainer.local.errors import AgentImportError, LocalStackError
    from agl_trainer.serving.fleet import NoServerLeftError

    try:
        config = check_config(args)
    except ConfigError as error:
        raise SystemExit(_fail(config_error_line(error), 2)) from None
    try:
        if args.is_production:
            from agl_trainer.assembly import run_from_files

            run_from_files(args.overrides)
        else:
            from agl_trainer.local.demo import run_embedded_default

            run = run_embedded_default(
                args.overrides,
                task=args.task or "digits",
                tool_latency=args.tool_latency,
                runner=args.runner or "local",
                controller_restarts=(
                    DEFAULT_CONTROLLER_RESTARTS
                    if args.controller_restarts is None
                    else args.controller_restarts
                ),
            )
            if not run.totals.samples_trained:
                raise SystemExit(1)
    except (AgentImportError, CheckpointStateMismatch, ServerSetupError) as error:
        raise SystemExit(_fail(f"agl-trainer: {error}", 2)) from None
    except (TooManyEmptySteps, NoServerLeftError) as error:
        raise SystemExit(_fail(f"agl-trainer: stopped: {error}", 1)) from None
    except LocalStackError as error:
        raise SystemExit(
            _fail(str(error) if str(error).startswith("agl-trainer:") else f"agl-trainer: {error}", 1)
        ) from None
    except Exception as error:
        from agl_trainer.settings.values import leaf_keys
        from agl_trainer.verl_glue.worker_errors import verl_check_line

        line = verl_check_line(error, leaf_keys(config))
        if line is None:
            raise
        raise SystemExit(_fail(line, 2)) from None


def _fail(line: str, code: int) -> int:
    print(line, file=terminal().err, flush=True)
    return code


def _refuse_embedded_options_in_production(args: CliArgs) -> None:
    if not args.is_production:
        return
    if args.tool_latency is not None:
        raise SystemExit(
            "agl-trainer: tool_latency= slows the embedded default's toy agents; a production run's agents are "
            "your own: drop tool_latency="
        )
    if args.runner is not None or args.controller_restarts is not None:
        what = (
            f"runner={args.runner}"
            if args.runner is not None
            else f"controller_restarts={args.controller_restarts}"
        )
        raise SystemExit(
            f"agl-trainer: {what} is about who runs the embedded default's toy agents; in a production "
            f"run your own agl-controller runs your agents: drop {what.split('=')[0]}="
        )
    if args.task is not None:
        raise SystemExit(
            f"agl-trainer: task={args.task} selects the embedded default's toy task, but the overrides name "
            f"a production setup (one of {', '.join(PRODUCTION_KEYS)}); drop task= and give data.train_files"
        )


class ConfigError(Exception):
    """The run's configuration cannot be trained with; the cause is verl's, Hydra's or agl's error."""


def check_config(args: CliArgs) -> DictConfig:
    """Compose and validate the run's config before any process starts and return it;
    :class:`ConfigError` if it fails.

    A production run's data files are read here too, so a missing or malformed file is named now.
    """
    from agl_trainer.assembly import CONFIG_ERRORS

    try:
        if args.is_production:
            from agl_trainer.assembly import load_rows, production_config
            from agl_trainer.settings import parse_settings

            config = production_config(args.overrides)
            parse_settings(config)
            load_rows(config.data.train_files, key="data.train_files")
            load_rows(config.data.val_files, key="data.val_files")
            return config
        from agl_trainer.local import demo

        return demo.check_config(args.overrides)
    except CONFIG_ERRORS as error:
        raise ConfigError(error) from error


def config_error_line(error: ConfigError) -> str:
    """``agl-trainer: <the cause's message on one line>``; the message names the key, value and fix."""
    cause = error.__cause__ or error
    return "agl-trainer: " + " ".join(str(cause).split())


def interrupted_line(interrupt: BaseException) -> str:
    """What Ctrl-C says: the step reached and the last checkpoint, when training had started.

    The trainer's :class:`~agl_trainer.assembly.TrainingInterrupted` is looked for along the chain
    of exceptions, since stopping the processes after it can raise another interrupt.
    """
    from agl_trainer.assembly import TrainingInterrupted

    seen: BaseException | None = interrupt
    while seen is not None:
        if isinstance(seen, TrainingInterrupted):
            return seen.summary()
        seen = seen.__cause__ or seen.__context__
    return "agl-trainer: interrupted before training started; nothing was saved"


if __name__ == "__main__":
    main()
