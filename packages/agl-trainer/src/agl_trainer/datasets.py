"""In-memory datasets for verl's dataloaders, bypassing its file-based ``RLHFDataset``.

A row is a JSON-like dict that becomes a rollout's ``input``; agl never tokenizes on the trainer
side (agents tokenize through the inference server), so rows stay plain Python.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch.utils.data import Dataset


class InMemoryDataset(Dataset[dict[str, Any]]):
    """A sequence of dict rows served as a torch ``Dataset``."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], *, name: str = "dataset") -> None:
        if len(rows) == 0:
            raise ValueError(f"{name} must be non-empty")
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping):  # pyright: ignore[reportUnnecessaryIsInstance]  (user input)
                raise ValueError(f"{name}[{i}] is a {type(row).__name__}; each row must be a dict")
        self._rows = [dict(row) for row in rows]

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return dict(self._rows[index])


def collate_rows(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """Rows → columns (dict of lists), the batch shape agl-rollout's managers take.

    A key missing from some rows is ``None`` there, so every column has one entry per row.
    """
    keys = list(dict.fromkeys(key for row in rows for key in row))
    return {key: [row.get(key) for row in rows] for key in keys}


__all__ = ("InMemoryDataset", "collate_rows")
