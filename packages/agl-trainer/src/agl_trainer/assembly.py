"""``run_ppo``: start Ray with agl's worker setup hook, build the trainer on in-memory data, train.

``run_from_files`` is the production run of ``agl-trainer``: the same, on rows read from
``data.train_files`` and ``data.val_files``.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ray
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from agl_trainer.datasets import InMemoryDataset
from agl_trainer.ray_local import LOOPBACK, cluster_address, loopback_only, on_loopback, use_run_token
from agl_trainer.serving.lora import ExternalLoraPush
from agl_trainer.serving.weights import ExternalVllmPush, NoWeightPush, WeightPusher
from agl_trainer.settings import ServerSettings, configure_verl, parse_settings
from agl_trainer.trainer import AglRayPPOTrainer
from agl_trainer.verl_glue.compat import check_verl_version
from agl_trainer.verl_glue.workers import ray_runtime_env

CONFIG_DIR = Path(__file__).parent / "config"
CONFIG_ERRORS: tuple[type[Exception], ...] = (ValueError, HydraException, OmegaConfBaseException)
"""What a bad configuration raises: agl's and verl's checks, Hydra's composition, omegaconf's access."""


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """agl-trainer's Hydra config (verl's ``ppo_trainer`` plus ``agentlightning.*``) with ``overrides``."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="agl_trainer", overrides=list(overrides))


def init_ray(config: DictConfig) -> None:
    """``ray.init`` with agl's runtime env merged under the user's ``ray_kwargs.ray_init`` (user keys win).

    With an address (``ray_kwargs.ray_init.address`` or ``RAY_ADDRESS``) it joins that cluster;
    without, the cluster it starts listens on loopback only and authenticates with a token of
    this run (:mod:`agl_trainer.ray_local`).
    """
    if ray.is_initialized():
        return
    section: Any = OmegaConf.select(config, "ray_kwargs.ray_init", default=None)
    ray_init: dict[str, Any] = OmegaConf.to_container(section) if section is not None else {}  # type: ignore[assignment]
    agl_env = ray_runtime_env(str(config.trainer.device))
    user_env = dict(ray_init.pop("runtime_env", None) or {})
    env_vars = {**agl_env["env_vars"], **dict(user_env.pop("env_vars", None) or {})}
    runtime_env = {**agl_env, **user_env, "env_vars": env_vars}
    ray_init = {key: value for key, value in ray_init.items() if value is not None}
    if os.environ.get("RAY_TMPDIR"):
        ray_init.setdefault("_temp_dir", os.environ["RAY_TMPDIR"])
    ray_init.setdefault("include_dashboard", False)
    joined = cluster_address(ray_init.get("address"))
    if joined is None:
        use_run_token()
        ray_init.setdefault("_node_ip_address", LOOPBACK)
    if joined is None or on_loopback(joined):
        with loopback_only():
            ray.init(runtime_env=runtime_env, **ray_init)
    else:
        ray.init(runtime_env=runtime_env, **ray_init)


def default_weight_pusher(server: ServerSettings) -> WeightPusher:
    """With ``agentlightning.external_servers.weights_dir`` set, external vLLM servers get the actor's
    LoRA adapter (``lora_rank`` > 0) or its full weights, moved as ``external_servers.transfer``
    says; without, no push."""
    if server.weights_dir is None:
        return NoWeightPush()
    if server.lora_rank > 0:
        return ExternalLoraPush(
            server.endpoints, server.model_name, server.weights_dir, transfer=server.transfer
        )
    return ExternalVllmPush(
        server.endpoints,
        server.model_name,
        server.weights_dir,
        initial_weights=server.initial_weights,
        transfer=server.transfer,
    )


def load_processor(model_path: str) -> Any | None:
    """verl's ``hf_processor`` of a vision-language model; None for a text model.

    verl turns a processor that fails to load into a warning and None, which would refuse the
    agents' images only at the first step; for a model with a vision tower it is an error now.
    """
    from transformers import AutoConfig
    from verl.utils import hf_processor

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        processor = hf_processor(model_path)
    for warning in caught:
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    if (
        processor is None
        and getattr(AutoConfig.from_pretrained(model_path), "vision_config", None) is not None
    ):
        causes = "; ".join(str(w.message).strip() for w in caught) or "no cause given"
        raise RuntimeError(
            f"actor_rollout_ref.model.path={model_path} is a vision-language model, but its HF processor "
            f"did not load ({causes}). Its agents' images cannot be trained on without it; transformers "
            "builds Qwen-VL processors on torchvision, so install the torchvision that matches torch."
        )
    return processor


def build_trainer(
    config: DictConfig,
    train_dataset: Sequence[Mapping[str, Any]],
    val_dataset: Sequence[Mapping[str, Any]],
    *,
    weight_pusher: WeightPusher | None = None,
    processor: Any | None = None,
) -> AglRayPPOTrainer:
    """Map the config onto settings (checking every key), start Ray, and build the trainer with its
    workers (not yet trained).

    ``processor``: the model's HF processor; None loads it (:func:`load_processor`).
    """
    from verl.utils import hf_tokenizer

    check_verl_version()
    settings = parse_settings(config)
    configure_verl(config, settings)
    train = InMemoryDataset(train_dataset, name="train_dataset")
    val = InMemoryDataset(val_dataset, name="val_dataset")
    model_path = str(config.actor_rollout_ref.model.path)
    if processor is None:
        processor = load_processor(model_path)
    init_ray(config)
    tokenizer = hf_tokenizer(model_path)
    trainer = AglRayPPOTrainer(
        config,
        settings,
        tokenizer,
        processor=processor,
        train_dataset=train,
        val_dataset=val,
        weight_pusher=weight_pusher or default_weight_pusher(settings.server),
    )
    try:
        trainer.init_workers()
    except BaseException:
        trainer.shutdown()
        raise
    return trainer


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`run_ppo`, after every worker and replica it started was stopped.

    ``step`` is the trainer's step when it was interrupted; ``checkpoint`` the newest checkpoint
    folder under ``trainer.default_local_dir`` (None when none was saved).
    """

    def __init__(self, step: int, checkpoint: str | None) -> None:
        super().__init__(step, checkpoint)
        self.step = step
        self.checkpoint = checkpoint

    def summary(self) -> str:
        """One line for the user: the step reached and where training can resume from."""
        where = f"last checkpoint {self.checkpoint}" if self.checkpoint else "no checkpoint saved"
        return f"agl-trainer: interrupted at step {self.step}; {where}"


def run_ppo(
    config: DictConfig,
    train_dataset: Sequence[Mapping[str, Any]],
    val_dataset: Sequence[Mapping[str, Any]],
    *,
    weight_pusher: WeightPusher | None = None,
) -> AglRayPPOTrainer:
    """Train on in-memory rows (each row becomes a rollout's ``input``); return the trainer.

    On every exit (success, error, Ctrl-C) the trainer's workers, verl's replicas and its server
    client are stopped first; Ctrl-C then raises :class:`TrainingInterrupted`.
    """
    trainer = build_trainer(config, train_dataset, val_dataset, weight_pusher=weight_pusher)
    try:
        trainer.fit()
    except KeyboardInterrupt as interrupt:
        raise TrainingInterrupted(trainer.global_steps, latest_checkpoint(config)) from interrupt
    finally:
        trainer.shutdown()
    return trainer


def latest_checkpoint(config: DictConfig) -> str | None:
    """The newest ``global_step_N`` folder verl recorded under ``trainer.default_local_dir``, or None."""
    from verl.utils.checkpoint.checkpoint_manager import get_checkpoint_tracker_filename

    root = Path(str(config.trainer.default_local_dir)).expanduser().absolute()
    tracker = Path(get_checkpoint_tracker_filename(str(root)))
    if not tracker.is_file():
        return None
    folder = root / f"global_step_{int(tracker.read_text().strip())}"
    return str(folder) if folder.is_dir() else None


PRODUCTION_REQUIRED_KEYS = (
    "actor_rollout_ref.model.path",
    "agentlightning.agl_base_url",
    "data.train_files",
    "data.val_files",
)
"""What a production run must be told: nothing is started or built for it, and verl's defaults for
these (a 7B model and gsm8k files under ~/data, a gateway on localhost) are rarely what is meant."""


def production_config(overrides: Sequence[str]) -> DictConfig:
    """The composed config of a production run; ``ValueError`` naming each required key not overridden."""
    given = {override.split("=", 1)[0].lstrip("+") for override in overrides}
    missing = [key for key in PRODUCTION_REQUIRED_KEYS if key not in given]
    if missing:
        raise ValueError(
            f"a production run (no local services) needs {', '.join(f'{key}=...' for key in missing)}; "
            "e.g. actor_rollout_ref.model.path=Qwen/Qwen2.5-1.5B-Instruct agentlightning.agl_base_url=http://gateway:8080 "
            "data.train_files=train.parquet data.val_files=test.parquet (run agl-trainer with none of "
            "model.path, agl_base_url or external_servers.endpoints for the embedded default)"
        )
    return compose_config(overrides)


def load_rows(files: str | Sequence[str], *, key: str) -> list[dict[str, Any]]:
    """The rows of one file or a list of files: ``.jsonl`` (one JSON object a line) or ``.parquet``.

    Each row becomes a rollout's ``input``. ``key`` (e.g. ``data.train_files``) is named in errors.
    """
    paths = [Path(files)] if isinstance(files, str) else [Path(str(f)) for f in files]
    rows: list[dict[str, Any]] = []
    for path in paths:
        path = path.expanduser()
        if not path.is_file():
            raise ValueError(f"{key}: {path} does not exist")
        if path.suffix == ".jsonl":
            lines = enumerate(path.read_text().splitlines(), start=1)
            rows += [_json_row(line, path, number, key) for number, line in lines if line.strip()]
        elif path.suffix == ".parquet":
            rows += _parquet_rows(path)
        else:
            raise ValueError(f"{key}: {path} is neither .jsonl nor .parquet; convert it to one of them")
    if not rows:
        raise ValueError(f"{key}: {[str(p) for p in paths]} hold no rows")
    return rows


def _json_row(line: str, path: Path, number: int, key: str) -> dict[str, Any]:
    """Line ``number`` of the JSONL file ``path`` as a row; ``key``, the file and the line are named in errors."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{key}: {path} line {number} is not valid JSON ({error})") from error
    if not isinstance(row, dict):
        raise ValueError(
            f"{key}: {path} has a line that is a {type(row).__name__}; each line must be a JSON object "
            f"(line {number})"
        )
    return row  # pyright: ignore[reportUnknownVariableType]  (JSON object)


def _parquet_rows(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq  # a dependency of verl

    # to_pylist gives plain lists and dicts (pandas would give numpy arrays, which are not JSON).
    return pq.read_table(path).to_pylist()


def run_from_files(overrides: Sequence[str]) -> AglRayPPOTrainer:
    """The production run: train on ``data.train_files``, validate on ``data.val_files``.

    Starts no agl-server, inference server or agents and builds no model: the config names them.
    An error gets :func:`outputs_note` added, which its traceback ends with.
    """
    config = production_config(overrides)
    train = load_rows(config.data.train_files, key="data.train_files")
    val = load_rows(config.data.val_files, key="data.val_files")
    try:
        return run_ppo(config, train, val)
    except Exception as error:
        error.add_note(outputs_note(config))
        raise


def outputs_note(config: DictConfig) -> str:
    """Where a production run leaves its outputs: ``trainer.default_local_dir``, absolute (verl's
    checkpoints, and agl's trajectories by default). A production run has no run folder of its own;
    this is the one place to look after a crash."""
    folder = Path(str(config.trainer.default_local_dir)).expanduser().absolute()
    return f"agl-trainer: run outputs (checkpoints, trajectories) under trainer.default_local_dir={folder}"


__all__ = (
    "CONFIG_DIR",
    "CONFIG_ERRORS",
    "PRODUCTION_REQUIRED_KEYS",
    "TrainingInterrupted",
    "build_trainer",
    "compose_config",
    "default_weight_pusher",
    "init_ray",
    "latest_checkpoint",
    "load_rows",
    "outputs_note",
    "production_config",
    "run_from_files",
    "run_ppo",
)
