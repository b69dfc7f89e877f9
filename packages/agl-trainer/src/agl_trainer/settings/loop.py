"""``LoopSettings``: what the fit loop reads from ``trainer.*``, and when a run that trains nothing stops."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from agl_trainer.settings.values import integer, optional_integer, select, select_or_null

MAX_EMPTY_STEPS_KEY = "agentlightning.max_empty_steps"


@dataclass(frozen=True, kw_only=True)
class LoopSettings:
    """Validation and checkpoint frequency (0: never, else also at the last step), verl's trackers,
    the critic warm-up, and ``max_empty_steps``: consecutive steps that train nothing before the run
    stops with an error (None: never)."""

    test_freq: int
    save_freq: int
    val_before_train: bool
    val_only: bool
    critic_warmup: int
    project_name: str
    experiment_name: str
    loggers: tuple[str, ...]
    max_empty_steps: int | None
    checkpoint_dir: Path
    """``trainer.default_local_dir``, absolute (a relative one is taken from the working directory)."""

    def validates_at(self, step: int, is_last: bool) -> bool:
        return self.test_freq > 0 and (is_last or step % self.test_freq == 0)

    def saves_at(self, step: int, is_last: bool) -> bool:
        return self.save_freq > 0 and (is_last or step % self.save_freq == 0)


def parse_loop(config: DictConfig) -> LoopSettings:
    trainer = config.trainer
    logger = trainer.logger
    loggers = (str(logger),) if isinstance(logger, str) else tuple(str(name) for name in logger)
    return LoopSettings(
        test_freq=int(trainer.test_freq),
        save_freq=int(trainer.save_freq),
        val_before_train=bool(select(config, "trainer.val_before_train", True)),
        val_only=bool(select(config, "trainer.val_only", False)),
        critic_warmup=integer("trainer.critic_warmup", int(trainer.critic_warmup), minimum=0),
        project_name=str(trainer.project_name),
        experiment_name=str(trainer.experiment_name),
        loggers=loggers,
        max_empty_steps=optional_integer(
            MAX_EMPTY_STEPS_KEY, select_or_null(config, MAX_EMPTY_STEPS_KEY, 5), minimum=1
        ),
        checkpoint_dir=Path(os.getcwd()) / str(trainer.default_local_dir),
    )


__all__ = ("MAX_EMPTY_STEPS_KEY", "LoopSettings", "parse_loop")
