"""The ``agl-trainer`` command line: shortcuts, overrides, which run they select, logging."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tqdm import tqdm

from agl_trainer import cli, local
from agl_trainer.cli import AGL_LOGGERS, CliArgs, configure_logging, interrupted_line, main, parse_args
from agl_trainer.local import ToolLatency


def test_shortcuts_map_onto_their_hydra_keys_before_the_overrides() -> None:
    args = parse_args(["task=digits", "steps=3", "--async", "level=transition", "data.train_batch_size=8"])
    assert args == CliArgs(
        task="digits",
        overrides=(
            "trainer.total_training_steps=3",
            "agentlightning.trace_aggregator.level=transition",
            "agentlightning.async_rollout.enabled=true",
            "agentlightning.fully_async.enabled=false",
            "data.train_batch_size=8",
        ),
    )


def test_flags_mean_the_same_as_short_keys() -> None:
    flags = parse_args(["--steps", "2", "--level", "trajectory", "--sync", "trainer.test_freq=1"])
    assert flags == parse_args(["steps=2", "level=trajectory", "mode=sync", "trainer.test_freq=1"])
    assert flags.overrides == (
        "trainer.total_training_steps=2",
        "agentlightning.trace_aggregator.level=trajectory",
        "agentlightning.async_rollout.enabled=false",
        "agentlightning.fully_async.enabled=false",
        "trainer.test_freq=1",
    )


def test_fully_async_shortcuts_map_onto_their_keys_and_tool_latency_onto_the_toy_task() -> None:
    args = parse_args(["--fully-async", "max_staleness=0", "tool_latency=0.5:6"])
    assert args == parse_args(["mode=fully-async", "--max-staleness", "0", "--tool-latency", "0.5:6"])
    assert args.overrides == (
        "agentlightning.async_rollout.enabled=false",
        "agentlightning.fully_async.enabled=true",
        "agentlightning.fully_async.max_staleness=0",
    )
    assert args.tool_latency == ToolLatency(0.5, 6.0)


def test_a_malformed_tool_latency_is_a_usage_error_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert "tool_latency='6:0.5'" in _usage_error(["tool_latency=6:0.5"], capsys)


def test_the_embedded_defaults_choices_copied_into_the_cli_are_its_own() -> None:
    assert tuple(sorted(local.TOY_TASKS)) == cli.TOY_TASK_NAMES
    assert cli.RUNNERS == local.RUNNERS
    assert cli.DEFAULT_CONTROLLER_RESTARTS == local.DEFAULT_CONTROLLER_RESTARTS


def test_no_arguments_ask_for_nothing() -> None:
    assert parse_args([]) == CliArgs(task=None, overrides=())


def test_task_upper_selects_the_capitals_task() -> None:
    assert parse_args(["task=upper"]) == CliArgs(task="upper", overrides=())


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What parsing ``argv`` writes to stderr; it must exit with argparse's usage status, 2."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_unknown_task_fails_listing_the_known_tasks(capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(["task=chess"], capsys)
    assert "argument --task: invalid choice: 'chess' (choose from 'digits', 'upper')" in err


def test_unknown_level_fails_listing_the_levels(capsys: pytest.CaptureFixture[str]) -> None:
    assert "invalid choice: 'episode' (choose from 'transition', 'trajectory')" in _usage_error(
        ["level=episode"], capsys
    )


def test_steps_below_one_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert "argument --steps: must be >= 1, got 0" in _usage_error(["steps=0"], capsys)


def test_sync_and_async_together_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert "argument --async: not allowed with argument --sync" in _usage_error(["--sync", "--async"], capsys)


def test_argument_without_equals_sign_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert "expected KEY=VALUE overrides, got ['trainer.total_training_steps']" in _usage_error(
        ["trainer.total_training_steps"], capsys
    )


def test_help_documents_the_shortcuts_and_the_production_run(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for expected in (
        "--task {digits,upper}",
        "task=upper steps=10",
        "--level {transition,trajectory}",
        "--async",
        "steps=N",
        "trainer.logger=[wandb]",
        "data.train_files and data.val_files",
    ):
        assert expected in text


@pytest.mark.parametrize(
    ("override", "production"),
    [
        ("actor_rollout_ref.model.path=Qwen/Qwen2.5-1.5B-Instruct", True),
        ("agentlightning.agl_base_url=http://gateway:8080", True),
        ("agentlightning.external_servers.endpoints=[http://vllm:8000/v1]", True),
        ("+actor_rollout_ref.model.path=/models/q", True),
        ("trainer.total_training_steps=3", False),
        ("actor_rollout_ref.model.path_suffix=x", False),
    ],
)
def test_overrides_naming_a_server_or_model_select_the_production_run(
    override: str, production: bool
) -> None:
    assert CliArgs(task=None, overrides=(override,)).is_production is production


def test_a_task_with_a_production_setup_is_refused() -> None:
    with pytest.raises(SystemExit, match="task=digits selects the embedded default's toy task"):
        main(["task=digits", "agentlightning.agl_base_url=http://gateway:8080"])


def test_configured_logging_shows_progress_lines_when_not_a_tty() -> None:
    stream = io.StringIO()
    handler = configure_logging(stream)
    try:
        # What agl_rollout.progress.WaitProgress logs instead of a live line when stderr is no TTY.
        logging.getLogger("agl_rollout.progress").info("train rollouts progress done=%d total=%d", 4, 4)
        logging.getLogger("httpx").info("HTTP Request: GET http://x")
    finally:
        for name in AGL_LOGGERS:
            logging.getLogger(name).removeHandler(handler)
            logging.getLogger(name).setLevel(logging.NOTSET)
            logging.getLogger(name).propagate = True
    [line] = stream.getvalue().splitlines()  # httpx's INFO line stays quiet
    assert line.endswith(" INFO agl_rollout.progress: train rollouts progress done=4 total=4")


def test_a_log_line_goes_above_the_progress_bar_instead_of_running_on_from_it() -> None:
    stream = io.StringIO()
    handler = configure_logging(stream)
    bar = tqdm(total=4, desc="Training Progress", file=stream)
    try:
        bar.update(1)
        logging.getLogger("agl_trainer").warning("step 1: all 16 rollouts failed")
    finally:
        bar.close()
        for name in AGL_LOGGERS:
            logging.getLogger(name).removeHandler(handler)
            logging.getLogger(name).setLevel(logging.NOTSET)
            logging.getLogger(name).propagate = True
    lines = stream.getvalue().replace("\r", "\n").splitlines()
    [warning] = [line for line in lines if "rollouts failed" in line]
    assert warning.split(" ", 1)[1] == "WARNING agl_trainer: step 1: all 16 rollouts failed"


def test_runner_controller_selects_the_real_agl_controller_for_the_toy_agents() -> None:
    assert parse_args(["runner=controller"]).runner == "controller"
    assert parse_args(["--runner", "local"]).runner == "local"
    assert parse_args([]).runner is None


def test_an_unknown_runner_fails_listing_the_runners(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["runner=k8s"])
    err = capsys.readouterr().err
    assert "argument --runner: invalid choice: 'k8s'" in err
    assert "local" in err and "controller" in err


def test_a_runner_with_a_production_setup_is_refused() -> None:
    with pytest.raises(SystemExit, match="drop runner="):
        main(["runner=controller", "agentlightning.agl_base_url=http://gateway:8080"])


@pytest.mark.parametrize(("setting", "uv_run_workers"), [(None, False), ("1", True)])
def test_ray_started_under_uv_run_keeps_its_workers_in_this_venv_unless_asked(
    setting: str | None, uv_run_workers: bool
) -> None:
    """``uv run agl-trainer`` must not make Ray build a venv per session for its workers."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_UV_RUN_RUNTIME_ENV"}
    if setting is not None:
        env["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = setting
    probe = "import agl_trainer.cli, ray._private.ray_constants as c; print(c.RAY_ENABLE_UV_RUN_RUNTIME_ENV)"
    out = subprocess.run([sys.executable, "-c", probe], env=env, check=True, capture_output=True, text=True)
    assert out.stdout.strip() == str(uv_run_workers)


def test_controller_restarts_maps_onto_the_embedded_default_and_is_refused_in_production() -> None:
    assert parse_args(["controller_restarts=5"]).controller_restarts == 5
    assert parse_args(["--controller-restarts", "0"]).controller_restarts == 0
    with pytest.raises(SystemExit, match="drop controller_restarts="):
        main(["controller_restarts=1", "agentlightning.agl_base_url=http://gateway:8080"])


def _agl_trainer(*args: str) -> subprocess.CompletedProcess[str]:
    command = [str(Path(sys.executable).with_name("agl-trainer")), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.verl
def test_a_configuration_error_is_one_line_naming_the_key_and_exit_code_2_before_anything_starts() -> None:
    done = _agl_trainer("actor_rollout_ref.actor.policy_loss.loss_mode=nope")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        "agl-trainer: actor_rollout_ref.actor.policy_loss.loss_mode='nope' is not registered in verl; registered: ["
    )
    assert "embedded default" not in done.stdout, "nothing started"


@pytest.mark.verl
@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("data.train_batch_size=0", "agl-trainer: data.train_batch_size must be an int >= 1, got 0"),
        (
            "actor_rollout_ref.rollout.n=0",
            "agl-trainer: actor_rollout_ref.rollout.n must be an int >= 1, got 0",
        ),
        ("data.max_response_length=-5", "agl-trainer: data.max_response_length must be an int >= 1, got -5"),
        (
            "agentlightning.fully_async.max_staleness=-1",
            "agl-trainer: agentlightning.fully_async.max_staleness must be null or an int >= 0, got -1",
        ),
    ],
)
def test_a_size_out_of_range_is_one_line_naming_the_key_and_value_with_exit_code_2(
    override: str, line: str
) -> None:
    done = _agl_trainer(override)
    assert (done.returncode, done.stderr.splitlines()[-1]) == (2, line)
    assert "embedded default" not in done.stdout, "nothing started"


@pytest.mark.verl
@pytest.mark.parametrize(
    ("mode", "gen_batch_size"),
    [("--sync", 6), ("--async", 6), ("--fully-async", 6), ("--sync", 2), ("--fully-async", 2)],
)
def test_a_gen_batch_size_other_than_the_train_batch_size_is_one_line_naming_both_keys_with_exit_code_2(
    mode: str, gen_batch_size: int
) -> None:
    # The command: with gen 6 > train 4 the run started no rollout in 420 s; with gen < train
    # (DAPO's recipes allow it, here with dynamic sampling on) a step could never fill.
    done = _agl_trainer(
        mode,
        "steps=3",
        "data.train_batch_size=4",
        f"data.gen_batch_size={gen_batch_size}",
        "algorithm.filter_groups.enable=true",
    )
    assert (done.returncode, done.stderr.splitlines()[-1]) == (
        2,
        f"agl-trainer: data.gen_batch_size ({gen_batch_size}) must be null or equal to "
        "data.train_batch_size (4): a step generates its train_batch_size groups, dynamic sampling "
        "refills a filtered group's place at once and --async / --fully-async run groups ahead, so no "
        "other generation batch is needed; remove data.gen_batch_size",
    )
    assert "embedded default" not in done.stdout, "nothing started"


@pytest.mark.verl
def test_a_command_started_with_verl_platform_cpu_in_its_environment_reads_its_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # agl's CPU mode exports VERL_PLATFORM=cpu to the processes it starts; verl reads it while its
    # engine is imported, before agl's CPU platform would otherwise be registered.
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    done = _agl_trainer("data.train_batch_size=0")
    assert (done.returncode, done.stderr.splitlines()[-1]) == (
        2,
        "agl-trainer: data.train_batch_size must be an int >= 1, got 0",
    )


@pytest.mark.verl
def test_an_unknown_key_is_one_line_with_hydras_fix_and_exit_code_2() -> None:
    done = _agl_trainer("trainer.no_such_key=1")
    assert (done.returncode, done.stderr.splitlines()[-1]) == (
        2,
        "agl-trainer: Could not override 'trainer.no_such_key'. To append to your config use +trainer.no_such_key=1",
    )


@pytest.mark.verl
def test_a_production_run_with_a_missing_data_file_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    done = _agl_trainer(
        "actor_rollout_ref.model.path=/models/q",
        "agentlightning.agl_base_url=http://127.0.0.1:1",
        f"data.train_files={tmp_path / 'train.jsonl'}",
        f"data.val_files={tmp_path / 'val.jsonl'}",
    )
    assert (done.returncode, done.stderr.splitlines()[-1]) == (
        2,
        f"agl-trainer: data.train_files: {tmp_path / 'train.jsonl'} does not exist",
    )


@pytest.mark.verl
def test_an_error_of_a_production_run_keeps_its_traceback_ending_with_where_the_run_leaves_its_outputs(
    tmp_path: Path,
) -> None:
    """An error agl-trainer has no line for: here a model folder without config.json, which
    transformers refuses while the trainer is built (before Ray starts)."""
    model, rows, outputs = tmp_path / "model", tmp_path / "rows.jsonl", tmp_path / "outputs"
    model.mkdir()
    rows.write_text('{"x": 1}\n')
    done = _agl_trainer(
        f"actor_rollout_ref.model.path={model}",
        "agentlightning.agl_base_url=http://127.0.0.1:1",
        f"data.train_files={rows}",
        f"data.val_files={rows}",
        f"trainer.default_local_dir={outputs}",
    )
    assert done.returncode == 1
    assert "Traceback (most recent call last):" in done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"agl-trainer: run outputs (checkpoints, trajectories) under trainer.default_local_dir={outputs}"
    )


@pytest.mark.verl
def test_the_production_key_can_come_from_the_environment_instead_of_the_command_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agl_trainer.assembly import compose_config
    from agl_trainer.settings import parse_settings

    monkeypatch.setenv("AGL_KEY", "s3cret")
    config = compose_config(["agentlightning.agl_key=${oc.env:AGL_KEY}"])
    assert parse_settings(config).server.key == "s3cret"


def test_ctrl_c_after_the_trainer_stopped_names_the_step_even_when_teardown_raised_another_interrupt() -> (
    None
):
    from agl_trainer.assembly import TrainingInterrupted

    try:
        try:
            raise TrainingInterrupted(3, None)
        except TrainingInterrupted:
            raise KeyboardInterrupt from None  # e.g. the stack's teardown, interrupted
    except KeyboardInterrupt as interrupt:
        assert interrupted_line(interrupt) == "agl-trainer: interrupted at step 3; no checkpoint saved"


@pytest.mark.verl
def test_ctrl_c_before_verl_recorded_a_checkpoint_says_none_was_saved(tmp_path: Path) -> None:
    """A ``global_step_N`` folder without verl's tracker file is a save cut short, not a checkpoint."""
    from agl_trainer.assembly import TrainingInterrupted, compose_config, latest_checkpoint

    (tmp_path / "global_step_1").mkdir()
    config = compose_config([f"trainer.default_local_dir={tmp_path}"])
    assert (
        interrupted_line(TrainingInterrupted(2, latest_checkpoint(config)))
        == "agl-trainer: interrupted at step 2; no checkpoint saved"
    )


def test_ctrl_c_before_the_trainer_ran_says_nothing_was_saved() -> None:
    assert (
        interrupted_line(KeyboardInterrupt())
        == "agl-trainer: interrupted before training started; nothing was saved"
    )
