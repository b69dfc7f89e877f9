"""The production run of ``agl-trainer``: required keys, and rows from data.train_files/val_files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agl_trainer.assembly import load_rows, production_config

pytestmark = pytest.mark.verl

_REQUIRED = (
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-1.5B-Instruct",
    "agentlightning.agl_base_url=http://gateway:8080",
    "data.train_files=/data/train.parquet",
    "data.val_files=/data/test.parquet",
)


def test_production_config_names_every_required_key_not_given() -> None:
    with pytest.raises(
        ValueError, match=r"needs agentlightning\.agl_base_url=\.\.\., data\.val_files=\.\.\.;"
    ):
        production_config([_REQUIRED[0], _REQUIRED[2]])


def test_production_config_is_the_composed_config_with_the_given_values() -> None:
    config = production_config([*_REQUIRED, "trainer.n_gpus_per_node=8"])
    assert config.actor_rollout_ref.model.path == "Qwen/Qwen2.5-1.5B-Instruct"
    assert config.agentlightning.agl_base_url == "http://gateway:8080"
    assert (config.data.train_files, config.data.val_files) == ("/data/train.parquet", "/data/test.parquet")
    assert config.trainer.n_gpus_per_node == 8


def test_jsonl_rows_are_read_in_order(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text('{"question": "1+1", "answer": 2}\n\n{"question": "2+2", "answer": 4}\n')
    assert load_rows(str(path), key="data.train_files") == [
        {"question": "1+1", "answer": 2},
        {"question": "2+2", "answer": 4},
    ]


def test_parquet_rows_are_plain_python_like_verls_preprocessed_files(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    rows = [
        {"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}},
        {"prompt": [{"role": "user", "content": "2+2?"}], "reward_model": {"ground_truth": "4"}},
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    loaded = load_rows(str(path), key="data.train_files")
    assert loaded == rows
    assert json.loads(json.dumps(loaded)) == rows  # JSON-ready: each row becomes a rollout input


def test_a_list_of_files_is_read_one_after_the_other(tmp_path: Path) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text('{"i": 1}\n')
    second.write_text('{"i": 2}\n{"i": 3}\n')
    assert load_rows([str(first), str(second)], key="data.train_files") == [{"i": 1}, {"i": 2}, {"i": 3}]


def test_a_missing_file_is_named_with_its_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"data.val_files: {tmp_path / 'none.jsonl'} does not exist"):
        load_rows(str(tmp_path / "none.jsonl"), key="data.val_files")


def test_another_format_is_refused_naming_the_supported_ones(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    path.write_text("a,b\n")
    with pytest.raises(ValueError, match=r"data.train_files: .*train.csv is neither .jsonl nor .parquet"):
        load_rows(str(path), key="data.train_files")


def test_a_jsonl_line_that_is_no_object_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text('{"i": 1}\n[1, 2]\n')
    with pytest.raises(
        ValueError, match=r"has a line that is a list; each line must be a JSON object \(line 2\)"
    ):
        load_rows(str(path), key="data.train_files")


def test_a_jsonl_line_that_is_no_json_is_refused_naming_key_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text('{"i": 1}\n\n{"i": 2,\n')
    with pytest.raises(ValueError, match=rf"data\.train_files: {path} line 3 is not valid JSON \(Expecting"):
        load_rows(str(path), key="data.train_files")


def test_files_without_rows_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match=r"data\.train_files: .* hold no rows"):
        load_rows(str(path), key="data.train_files")
