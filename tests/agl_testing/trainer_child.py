"""A trainer in a process of its own, for tests that SIGKILL it mid-run.

``python -m agl_testing.trainer_child SPEC`` reads SPEC (JSON: ``overrides``, ``train_rows``,
``val_rows``, ``record``), builds the trainer as ``agl-trainer`` does and fits. It appends to the
``record`` file, one JSON line each, flushed and synced so a kill loses none that was written:

- ``{"drawn": [x, ...]}``: samples the collector drew from the loader (their ``x``);
- ``{"checkpoint": step}``: a checkpoint of ``step`` began (no sample is drawn until it ends);
- ``{"trained": [x, ...], "step": step}``: the samples of the groups a step trained.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO


def _append(out: TextIO, entry: dict[str, Any]) -> None:
    out.write(json.dumps(entry) + "\n")
    out.flush()
    os.fsync(out.fileno())


def _xs(batch: Mapping[str, Any]) -> list[int]:
    return [int(x) for x in batch["x"]]


def main(spec_path: str) -> None:
    from agl_trainer.verl_glue.cpu_platform import enable_cpu_platform

    enable_cpu_platform()  # before verl's modules that read the device at import time
    from agl_trainer.assembly import build_trainer, compose_config, init_ray

    spec = json.loads(Path(spec_path).read_text())
    config = compose_config(spec["overrides"])
    init_ray(config)
    trainer = build_trainer(config, spec["train_rows"], spec["val_rows"])
    with Path(spec["record"]).open("a") as out:
        _record(trainer, out)
        try:
            trainer.fit()
        finally:
            trainer.shutdown()


def _record(trainer: Any, out: TextIO) -> None:
    """Wrap ``trainer``'s draws, checkpoints and batches so each appends its line to ``out``."""
    collection = trainer.collection
    next_batch, build_batch, admission_held = (
        collection.top_up.next_batch,
        trainer.adapter.build_batch,
        collection.admission_held,
    )

    def recording_next_batch(size: int) -> dict[str, Any]:
        batch = next_batch(size)
        _append(out, {"drawn": _xs(batch)})
        return batch

    def recording_build_batch(completed: Any, **kwargs: Any) -> Any:
        _append(out, {"trained": [int(r.input["x"]) for r in completed], "step": trainer.global_steps})
        return build_batch(completed, **kwargs)

    @contextmanager
    def recording_admission_held() -> Generator[None]:
        with admission_held():
            _append(out, {"checkpoint": trainer.global_steps})
            yield

    collection.top_up.next_batch = recording_next_batch
    trainer.adapter.build_batch = recording_build_batch
    collection.admission_held = recording_admission_held


if __name__ == "__main__":
    main(sys.argv[1])
