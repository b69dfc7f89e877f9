"""Train batches in the two shapes callers hold, and the top-up helper of the async mode.

A batch is either a mapping of column name to a sequence (verl's ``non_tensor_batch``: a
dict of numpy object arrays; also lists or tensors) or a list of row dicts.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from agl_rollout.convert import to_native

Batch = Mapping[str, Any] | Sequence[Mapping[str, Any]]


def batch_len(batch: Batch) -> int:
    """Number of samples in ``batch``; every column of a mapping must have that length."""
    if not isinstance(batch, Mapping):
        return len(batch)
    lengths = {key: len(column) for key, column in batch.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(
            f"batch columns differ in length: {lengths}; every column needs one value per sample"
        )
    return next(iter(lengths.values()), 0)


def batch_rows(batch: Batch) -> list[dict[str, Any]]:
    """The samples of ``batch`` as new plain-JSON dicts (the caller's batch is never touched)."""
    if not isinstance(batch, Mapping):
        return [to_native(row) for row in batch]
    n = batch_len(batch)
    return [{str(key): to_native(column[i]) for key, column in batch.items()} for i in range(n)]


def _concat(key: str, parts: list[Any]) -> Any:
    """The column ``parts`` end to end. Arrays and tensors are joined by the library that made them,
    which is loaded already since they exist: agl-rollout itself imports neither numpy nor torch."""
    first = parts[0]
    library = sys.modules.get(type(first).__module__.split(".")[0])
    if isinstance(first, list):
        return [item for part in parts for item in part]
    if library is not None and library.__name__ == "numpy":
        return library.concatenate(parts, axis=0)
    if library is not None and library.__name__ == "torch":
        return library.cat(parts, dim=0)
    raise TypeError(
        f"unsupported batch value type for key {key!r}: {type(first).__qualname__}; "
        "columns must be lists, numpy arrays or torch tensors"
    )


def _split(batch: Mapping[str, Any], head: int) -> tuple[dict[str, Any], dict[str, Any]]:
    return {k: v[:head] for k, v in batch.items()}, {k: v[head:] for k, v in batch.items()}


class BatchTopUp:
    """Cuts batches of any requested size out of an endless stream of dataloader batches.

    ``new_epoch()`` must return a fresh iterator over column-mapping batches (one epoch);
    it is called again whenever one runs out, and ``epoch`` counts those calls. A batch
    split to fit a request keeps its tail for the next request, so no sample is skipped.
    """

    def __init__(self, new_epoch: Callable[[], Iterable[Mapping[str, Any]]]) -> None:
        self._new_epoch = new_epoch
        self._iterator: Iterator[Mapping[str, Any]] | None = None
        self._leftover: Mapping[str, Any] | None = None
        self.epoch = 0

    def next_batch(self, size: int) -> dict[str, Any]:
        """The next ``size`` samples, concatenated per column."""
        if size <= 0:
            raise ValueError(f"size must be > 0, got {size}")
        parts: list[Mapping[str, Any]] = []
        need = size
        while need > 0:
            part = self._take()
            n = batch_len(part)
            if n > need:
                part, self._leftover = _split(part, need)
                n = need
            parts.append(part)
            need -= n
        keys = list(parts[0])
        return {key: _concat(key, [p[key] for p in parts]) for key in keys}

    def leftover_rows(self) -> list[dict[str, Any]]:
        """The samples cut off the last dataloader batch and not handed out yet, as plain-JSON rows
        (a checkpoint saves them: the dataloader's own state has moved past them)."""
        return batch_rows(self._leftover) if self._leftover is not None else []

    def restore_leftover(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Hand ``rows`` out first (a resumed run's :meth:`leftover_rows`)."""
        if rows:
            self._leftover = {key: [row[key] for row in rows] for key in rows[0]}

    def _take(self) -> Mapping[str, Any]:
        if self._leftover is not None:
            leftover, self._leftover = self._leftover, None
            return leftover
        for _ in range(2):
            if self._iterator is None:
                self._iterator = iter(self._new_epoch())
                self.epoch += 1
            for part in self._iterator:
                if batch_len(part) > 0:
                    return part
            self._iterator = None
        raise ValueError("the dataset yields no samples: new_epoch() returned an empty epoch twice")


__all__ = ("Batch", "BatchTopUp", "batch_len", "batch_rows")
