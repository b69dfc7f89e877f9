"""Batches as verl holds them: numpy object arrays and torch tensors (skipped without them)."""

from __future__ import annotations

from typing import Any

from agl_testing.requirements import import_optional

np = import_optional("numpy")
torch = import_optional("torch")

from agl_rollout import BatchTopUp, batch_rows, to_native  # noqa: E402


def test_to_native_converts_numpy_and_torch_values_to_plain_json() -> None:
    value = {
        "a": np.int64(3),
        "b": np.array([1.5, 2.5]),
        "c": torch.tensor([[1, 2]]),
        "d": (torch.tensor(7),),
    }
    assert to_native(value) == {"a": 3, "b": [1.5, 2.5], "c": [[1, 2]], "d": [7]}
    assert type(to_native(np.float32(0.5))) is float


def test_batch_rows_reads_verl_non_tensor_batch_of_numpy_object_arrays() -> None:
    batch = {"x": np.array([1, 2], dtype=object), "y": np.array([{"k": np.int32(1)}, None], dtype=object)}
    assert batch_rows(batch) == [{"x": 1, "y": {"k": 1}}, {"x": 2, "y": None}]


def test_batch_top_up_concatenates_numpy_and_torch_columns() -> None:
    def new_epoch() -> list[dict[str, Any]]:
        return [{"x": np.arange(3), "t": torch.arange(3)}]

    top_up = BatchTopUp(new_epoch)
    top_up.next_batch(2)
    second = top_up.next_batch(3)
    assert second["x"].tolist() == [2, 0, 1]
    assert second["t"].tolist() == [2, 0, 1]
