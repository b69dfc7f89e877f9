"""Vectorised grouping of row ids (rollout ids, GRPO uids) into integer codes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

IdArray = Sequence[Any] | npt.NDArray[Any] | torch.Tensor
"""One id per row: a list, a 1-D numpy array (object, str or int) or a 1-D integer tensor."""


@dataclass(frozen=True, slots=True)
class Factorized:
    """Ids mapped to codes ``0..K-1`` numbered in order of first appearance.

    ``codes`` (N,) int64: the code of each row. ``first_rows`` (K,) int64, ascending: the row where
    each id first appears. ``values`` (K,): the ids themselves, in code order.
    """

    codes: npt.NDArray[np.int64]
    first_rows: npt.NDArray[np.int64]
    values: npt.NDArray[Any]

    @property
    def n_unique(self) -> int:
        return int(self.first_rows.shape[0])


def as_id_array(ids: IdArray, *, name: str) -> npt.NDArray[Any]:
    """Return ``ids`` as a 1-D numpy array without copying a numpy input."""
    array = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional (one id per row), got shape {array.shape}")
    return array


def factorize(ids: IdArray, *, name: str) -> Factorized:
    """Group equal ids with dicts in O(N) (no sort, so no ordering of mixed or object ids needed)."""
    array = as_id_array(ids, name=name)
    items = array.tolist()
    try:
        # dict.fromkeys keeps first-appearance order; both passes run at C speed.
        code_of = {value: code for code, value in enumerate(dict.fromkeys(items))}
    except TypeError as error:
        raise ValueError(f"{name} must hold hashable ids (str or int), got {error}") from error
    codes = np.fromiter(map(code_of.__getitem__, items), dtype=np.int64, count=len(items))
    # Codes are numbered in order of first appearance, so a row starts a new id exactly where
    # the running maximum of the codes grows.
    first_rows = np.flatnonzero(np.diff(np.maximum.accumulate(codes), prepend=-1) > 0)
    return Factorized(codes=codes, first_rows=first_rows.astype(np.int64), values=array[first_rows])


def plain(value: Any) -> Any:
    """A numpy scalar as the Python value it holds, so error messages show ``'r1'``, not ``np.str_('r1')``."""
    return value.item() if isinstance(value, np.generic) else value
