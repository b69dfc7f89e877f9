"""Rows with images through a real (tiny) Qwen2-VL processor: ``multi_modal_inputs`` and the (4, L)
mrope ``position_ids``, exact; a row whose images and tokens disagree never trains."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_adapter import AdapterBatch, InvalidImagesError, RolloutAdapter, load_image
from agl_testing.requirements import import_optional
from agl_testing.routes import succeeded_rollout
from agl_types import Triplet

import_optional("transformers")

from agl_testing.vision import placeholder, png_data_url, png_file_url, tiny_vl_processor  # noqa: E402

PAD = 0


@pytest.fixture(scope="module")
def processor() -> Any:
    return tiny_vl_processor()


def _adapter(processor: Any, p: int, r: int, level: str = "transition") -> RolloutAdapter:
    return RolloutAdapter(
        max_prompt_length=p,
        max_response_length=r,
        pad_token_id=PAD,
        trace_aggregator_level=level,
        processor=processor,
    )


def _vision(processor: Any, urls: list[str]) -> dict[str, torch.Tensor]:
    outputs = processor(text=["dummy"], images=[load_image(url) for url in urls], return_tensors="pt")
    return {key: outputs[key] for key in ("pixel_values", "image_grid_thw")}


def _assert_inputs(actual: dict[str, torch.Tensor] | None, expected: dict[str, torch.Tensor]) -> None:
    assert actual is not None
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


def _build(adapter: RolloutAdapter, *triplets: Triplet) -> AdapterBatch:
    batch, _ = adapter.build_batch([succeeded_rollout(triplets)])
    return batch


def test_an_image_row_gets_the_processors_vision_tensors_and_mrope_positions_a_text_row_plain_ones(
    processor: Any,
) -> None:
    image = png_data_url(2, 2)
    prompt = [5, *placeholder(processor, 2, 2), 6]  # 5, start, 4 pads, end, 6
    batch = _build(
        _adapter(processor, p=10, r=3),
        Triplet(prompt_token_ids=prompt, response_token_ids=[7, 8], image_urls=[image]),
        Triplet(prompt_token_ids=[9, 9], response_token_ids=[4]),
    )
    assert batch.multi_modal_inputs is not None
    _assert_inputs(batch.multi_modal_inputs[0], _vision(processor, [image]))
    assert batch.multi_modal_inputs[0]["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert batch.multi_modal_inputs[1] is None
    # Text row: 1 on padding, 0.. on tokens. Vision rows: the 2 x 2 merged patches sit at
    # (t, h, w) = 2 + (0, row, col), and text after them resumes at 2 + 2 = 4; 0 on padding.
    assert batch.position_ids[0].tolist() == [
        [1, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1],
        [0, 0, 0, 1, 2, 2, 2, 2, 4, 5, 6, 7, 0],
        [0, 0, 0, 1, 2, 2, 3, 3, 4, 5, 6, 7, 0],
        [0, 0, 0, 1, 2, 3, 2, 3, 4, 5, 6, 7, 0],
    ]
    assert batch.position_ids[1].tolist() == [[1] * 8 + [0, 1, 2] + [1, 1]] * 4
    assert list(batch.non_tensors()["multi_modal_inputs"]) == list(batch.multi_modal_inputs)


def test_a_batch_without_images_keeps_plain_positions_and_no_multi_modal_inputs(processor: Any) -> None:
    batch = _build(_adapter(processor, p=3, r=2), Triplet(prompt_token_ids=[1, 2], response_token_ids=[3]))
    assert batch.multi_modal_inputs is None
    assert batch.position_ids.tolist() == [[0, 0, 1, 2, 2]]


def test_a_merged_row_takes_its_last_calls_images_which_hold_every_image_of_the_row(
    processor: Any, tmp_path: Path
) -> None:
    first, second = png_data_url(1, 1, shade=1), png_file_url(tmp_path, 2, 1, shade=2)
    prompt = [5, *placeholder(processor, 1, 1)]
    observation = [6, *placeholder(processor, 2, 1)]
    triplets = (
        Triplet(prompt_token_ids=prompt, response_token_ids=[7], image_urls=[first]),
        Triplet(
            prompt_token_ids=[*prompt, 7, *observation], response_token_ids=[8], image_urls=[first, second]
        ),
    )
    batch = _build(_adapter(processor, p=4, r=8, level="trajectory"), *triplets)
    assert batch.multi_modal_inputs is not None
    _assert_inputs(batch.multi_modal_inputs[0], _vision(processor, [first, second]))
    # 5 start [pad] end 7 6 start [pad pad] end 8: the first image is one patch at 2 (text resumes
    # at 2 + 1), the second one row of two patches at 7 + (0, 0, col) (text resumes at 7 + 2).
    assert batch.position_ids[0].tolist() == [
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1],
        [0, 1, 2, 3, 4, 5, 6, 7, 7, 9, 10, 0],
        [0, 1, 2, 3, 4, 5, 6, 7, 7, 9, 10, 0],
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0],
    ]


@pytest.fixture(scope="module")
def unbound() -> Any:
    """The same processor as ``AutoProcessor.from_pretrained`` gives it: no bound get_rope_index."""
    return tiny_vl_processor(bind_rope_index=False)


def test_a_qwen_vl_processor_without_a_bound_rope_index_is_recognised_by_class_and_gets_mrope_positions(
    unbound: Any,
) -> None:
    prompt = [5, *placeholder(unbound, 2, 1), 6, *placeholder(unbound, 1, 2)]
    triplet = Triplet(
        prompt_token_ids=prompt, response_token_ids=[7], image_urls=[png_data_url(2, 1), png_data_url(1, 2)]
    )
    batch = _build(_adapter(unbound, p=10, r=2), triplet)
    # 5 start [pad pad] end 6 start [pad pad] end 7 (padding): one row of two patches at 2 + (0, 0, col),
    # text resumes at 2 + 2; one column of two at 7 + (0, row, 0), text resumes at 7 + 2; 1 on padding.
    assert batch.position_ids.tolist() == [
        [
            [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1],
            [0, 1, 2, 2, 4, 5, 6, 7, 7, 9, 10, 1],
            [0, 1, 2, 2, 4, 5, 6, 7, 8, 9, 10, 1],
            [0, 1, 2, 3, 4, 5, 6, 7, 7, 9, 10, 1],
        ]
    ]


@settings(max_examples=40, deadline=None)
@given(
    calls=st.lists(
        st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(0, 3)), min_size=1, max_size=3
    ),
    response=st.lists(st.integers(1, 99), min_size=1, max_size=4),
    spare=st.integers(0, 3),
)
def test_an_unbound_qwen_vl_processor_gives_every_token_the_positions_the_bound_one_gives(
    processor: Any, unbound: Any, calls: list[tuple[int, int, int]], response: list[int], spare: int
) -> None:
    """Images of 1 to 3 x 1 to 3 cells, each after 0 to 3 text tokens; padding aside, the positions
    equal those of the model's own get_rope_index."""
    prompt: list[int] = []
    for w, h, text in calls:
        prompt += [*range(1, text + 1), *placeholder(processor, w, h)]
    urls = [png_data_url(w, h, shade=k) for k, (w, h, _) in enumerate(calls)]
    triplet = Triplet(prompt_token_ids=prompt, response_token_ids=response, image_urls=urls)
    p, r = len(prompt) + spare, len(response) + spare
    theirs, ours = _build(_adapter(processor, p, r), triplet), _build(_adapter(unbound, p, r), triplet)
    valid = ours.attention_mask[0].bool()
    assert torch.equal(ours.position_ids[0][:, valid], theirs.position_ids[0][:, valid])


def test_a_qwen_vl_processor_that_cannot_give_mrope_positions_is_an_error_naming_its_class() -> None:
    from agl_trainer.local.tiny_model import build_tiny_tokenizer

    processor = tiny_vl_processor(bind_rope_index=False)
    processor.tokenizer = build_tiny_tokenizer()  # without Qwen-VL's <|vision_start|>
    image = processor.image_token_id
    triplet = Triplet(
        prompt_token_ids=[5, *[image] * 4], response_token_ids=[7], image_urls=[png_data_url(2, 2)]
    )
    with pytest.raises(InvalidImagesError) as raised:
        _build(_adapter(processor, p=5, r=1), triplet)
    assert str(raised.value) == (
        "the processor ImageOnlyQwen2VLProcessor is a Qwen-VL one without a bound get_rope_index, and mrope "
        "positions need the <|vision_start|> token id: load it with verl's hf_processor "
        "(verl.utils.tokenizer.hf_processor), which binds the model's get_rope_index"
    )


def _assert_dropped(batch: AdapterBatch, metrics: dict[str, Any], row: int) -> None:
    """Row ``row`` never trains, keeps no images and has plain positions on all four rows."""
    assert batch.is_drop_mask[row]
    assert batch.multi_modal_inputs is None or batch.multi_modal_inputs[row] is None
    valid = batch.attention_mask[row].bool()
    text = list(range(int(valid.sum())))
    assert all(positions[valid].tolist() == text for positions in batch.position_ids[row])
    assert metrics["training/n_image_rows_dropped"] == 1


def test_a_response_cut_through_an_image_drops_the_row_with_a_warning_naming_rollout_and_turn(
    processor: Any, caplog: pytest.LogCaptureFixture
) -> None:
    prompt = [5, 6]
    triplets = (
        Triplet(prompt_token_ids=prompt, response_token_ids=[7]),
        Triplet(
            prompt_token_ids=[*prompt, 7, *placeholder(processor, 2, 2)],
            response_token_ids=[8],
            image_urls=[png_data_url(2, 2)],
        ),
    )
    with caplog.at_level(logging.WARNING, logger="agl_adapter"):
        batch, metrics = _adapter(processor, p=2, r=4, level="trajectory").build_batch(
            [succeeded_rollout(triplets)]
        )
    _assert_dropped(batch, metrics, 0)
    assert (
        "rollout 'r1' turn 1: row dropped: its tokens hold 2 image placeholder tokens, its 1 image(s) expand to 4"
        in caplog.text
    )


def test_images_that_are_not_the_prompts_drop_the_row(processor: Any) -> None:
    prompt = [5, *placeholder(processor, 1, 1)]
    urls = [png_data_url(1, 1), png_data_url(1, 1, 3)]
    rollouts = [
        succeeded_rollout([Triplet(prompt_token_ids=prompt, response_token_ids=[7], image_urls=urls)]),
        succeeded_rollout([Triplet(prompt_token_ids=[4], response_token_ids=[7])], rollout_id="r2", sample=1),
    ]
    batch, metrics = _adapter(processor, p=8, r=2).build_batch(rollouts)
    _assert_dropped(batch, metrics, 0)
    assert not batch.is_drop_mask[1]


def test_image_tokens_without_images_drop_the_row_even_in_a_batch_without_images(processor: Any) -> None:
    triplet = Triplet(prompt_token_ids=[5, *placeholder(processor, 1, 1)], response_token_ids=[7])
    batch, metrics = _adapter(processor, p=8, r=2).build_batch([succeeded_rollout([triplet])])
    assert batch.multi_modal_inputs is None
    assert batch.is_drop_mask.tolist() == [True]
    assert metrics["training/n_image_rows_dropped"] == 1


def test_an_image_that_does_not_load_drops_the_row_naming_rollout_turn_and_url(
    processor: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = f"file://{tmp_path / 'missing.png'}"
    triplet = Triplet(
        prompt_token_ids=[5, *placeholder(processor, 1, 1)], response_token_ids=[7], image_urls=[missing]
    )
    with caplog.at_level(logging.WARNING, logger="agl_adapter"):
        batch, metrics = _adapter(processor, p=8, r=2).build_batch([succeeded_rollout([triplet])])
    _assert_dropped(batch, metrics, 0)
    assert f"rollout 'r1' turn 0: row dropped: cannot load image '{missing}'" in caplog.text


def test_a_cut_prompt_keeps_no_images_and_plain_positions_as_it_never_trains(processor: Any) -> None:
    prompt = [5, *placeholder(processor, 1, 1)]
    triplet = Triplet(prompt_token_ids=prompt, response_token_ids=[7], image_urls=[png_data_url(1, 1)])
    batch = _build(_adapter(processor, p=2, r=2), triplet)
    assert batch.is_drop_mask.tolist() == [True]
    assert batch.multi_modal_inputs is not None and batch.multi_modal_inputs[0] is None
    assert batch.position_ids[0].tolist() == [[0, 1, 2, 1]] * 4


@st.composite
def _image_calls(draw: st.DrawFn) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """Image sizes (in merged cells) and the text runs around them: text, image, text, ..., text."""
    sizes = draw(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3)), min_size=1, max_size=3))
    texts = draw(
        st.lists(st.lists(st.integers(1, 99), max_size=3), min_size=len(sizes) + 1, max_size=len(sizes) + 1)
    )
    return sizes, texts


@settings(max_examples=40, deadline=None)
@given(
    calls=_image_calls(),
    response=st.lists(st.integers(1, 99), min_size=1, max_size=4),
    spare=st.integers(0, 3),
)
def test_padding_never_changes_a_rows_positions_or_vision_tensors(
    processor: Any, calls: tuple[list[tuple[int, int]], list[list[int]]], response: list[int], spare: int
) -> None:
    """Whatever the images and the padding, the row's tokens get the positions and vision tensors
    the processor and the model's own rope index give the unpadded call."""
    sizes, texts = calls
    urls = [png_data_url(w, h, shade=k) for k, (w, h) in enumerate(sizes)]
    prompt = list(texts[0])
    for (w, h), text in zip(sizes, texts[1:], strict=True):
        prompt += [*placeholder(processor, w, h), *text]
    tokens = torch.tensor([[*prompt, *response]])
    vision = _vision(processor, urls)
    image_token = processor.image_token_id
    expected, _ = processor.get_rope_index(
        input_ids=tokens,
        mm_token_type_ids=(tokens == image_token).long(),
        image_grid_thw=vision["image_grid_thw"],
    )
    batch = _build(
        _adapter(processor, p=len(prompt) + spare, r=len(response) + spare),
        Triplet(prompt_token_ids=prompt, response_token_ids=response, image_urls=urls),
    )
    valid = batch.attention_mask[0].bool()
    assert batch.multi_modal_inputs is not None
    _assert_inputs(batch.multi_modal_inputs[0], vision)
    assert torch.equal(batch.position_ids[0][1:, valid], expected[:, 0])
    assert batch.position_ids[0][0, valid].tolist() == list(range(tokens.shape[1]))
