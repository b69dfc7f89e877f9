"""Vision-language rows: each row's images → verl's ``multi_modal_inputs`` and mrope ``position_ids``.

A row's images are those of the last model call it holds: that call's messages carry every image
of the row's context, in order. The HF processor (verl's ``hf_processor``) turns them into the
vision tensors the model's forward takes (``pixel_values``, ``image_grid_thw``, ...); for mrope
models (Qwen2/2.5/3-VL: the processor has verl's bound ``get_rope_index``) every row gets (4, L)
position ids, a text row over three vision rows, which is how verl's engine recognises mrope.

Before any tensor is built, the row's image placeholder tokens are counted against what its images
need, so images are never trained under the wrong tokens: a mismatch is an InvalidImagesError
naming the rollout and the turn.
"""

from __future__ import annotations

import base64
import binascii
import inspect
import io
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import PIL.Image
import torch
from numpy.typing import NDArray

from agl_adapter.errors import InvalidImagesError

if TYPE_CHECKING:
    from agl_adapter._rows import TrainingRow

Image = PIL.Image.Image

MAX_REMOTE_IMAGE_BYTES = 50 * 1024 * 1024
REMOTE_IMAGE_TIMEOUT_S = 60.0
_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "mm_token_type_ids"})
_IMAGE_TYPE = 1


def _short(url: str) -> str:
    """A URL for a message: inline ``data:`` payloads cut to their head."""
    return url[:61] + "..." if url.startswith("data:") and len(url) > 64 else url


def _open(data: bytes) -> Image:
    return PIL.Image.open(io.BytesIO(data)).convert("RGB")


def _fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=REMOTE_IMAGE_TIMEOUT_S) as reply:
        content_type = reply.headers.get("content-type", "")
        if not content_type.startswith("image/"):
            raise ValueError(f"the server sent content-type {content_type!r}, not an image")
        data = reply.read(MAX_REMOTE_IMAGE_BYTES + 1)
    if len(data) > MAX_REMOTE_IMAGE_BYTES:
        raise ValueError(f"the image is over {MAX_REMOTE_IMAGE_BYTES} bytes")
    return data


def load_image(url: str) -> Image:
    """An RGB PIL image from a ``data:`` (base64), ``file://`` or ``http(s)://`` URL."""
    if url.startswith("data:"):
        _, _, payload = url.partition(",")
        try:
            return _open(base64.b64decode(payload, validate=True))
        except binascii.Error as exc:
            raise ValueError(f"the data URL is not base64 ({exc})") from exc
    if url.startswith("file://"):
        return _open(Path(url.removeprefix("file://")).read_bytes())
    if url.startswith(("http://", "https://")):
        return _open(_fetch(url))
    raise ValueError("only data:, file:// and http(s):// image URLs are supported")


def processor_token_id(processor: Any, name: str) -> int | None:
    """The id of the processor's ``image``/``video`` placeholder token, as verl resolves it."""
    token_id = getattr(processor, f"{name}_token_id", None)
    if token_id is not None:
        return int(token_id)
    token = getattr(processor, f"{name}_token", None)
    tokenizer = getattr(processor, "tokenizer", None)
    if token is None or tokenizer is None:
        return None
    converted = tokenizer.convert_tokens_to_ids(token)
    return converted if isinstance(converted, int) else None


@dataclass(frozen=True)
class VisionBatch:
    """Per row: the vision tensors (None for a row without images) and, for mrope, (4, L) positions."""

    multi_modal_inputs: NDArray[np.object_]
    position_ids: torch.Tensor | None


def _text_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """0, 1, ... on the row's tokens and 1 on padding: the text row of verl's mrope layout."""
    valid = attention_mask.bool()
    positions = torch.ones(len(attention_mask), dtype=torch.long)
    positions[valid] = torch.arange(int(valid.sum()))
    return positions


@dataclass(frozen=True)
class MropeIndex:
    """A model's ``get_rope_index``, bound to its processor by verl's ``hf_processor``."""

    rope_index: Callable[..., Any]
    image_token: int | None
    takes_type_ids: bool
    """transformers >= 5.3 finds the images by ``mm_token_type_ids`` rather than by token id."""

    @classmethod
    def of(cls, processor: Any) -> MropeIndex | None:
        rope_index = getattr(processor, "get_rope_index", None)
        if rope_index is None:
            return None
        takes_type_ids = "mm_token_type_ids" in inspect.signature(rope_index).parameters
        return cls(rope_index, processor_token_id(processor, "image"), takes_type_ids)

    def positions(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_grid_thw: torch.Tensor | None
    ) -> torch.Tensor:
        """(4, L): the text row over the model's three vision rows; a row without images (None) is
        text on all four, as get_rope_index gives a text-only row."""
        text = _text_positions(attention_mask)
        if image_grid_thw is None:
            return text.expand(4, -1).clone()
        kwargs: dict[str, Any] = {
            "input_ids": input_ids[None],
            "attention_mask": attention_mask[None],
            "image_grid_thw": image_grid_thw,
            "video_grid_thw": None,
        }
        if self.takes_type_ids:
            kwargs["mm_token_type_ids"] = ((input_ids == self.image_token) * _IMAGE_TYPE)[None]
        result = self.rope_index(**kwargs)
        vision = result[0] if isinstance(result, tuple) else result  # (3, 1, L)
        return torch.cat([text[None], vision[:, 0, :].to(torch.long)])


@dataclass
class VisionEncoder:
    """Runs ``processor`` on rows' images; loaded images are kept by URL for the batch being built."""

    processor: Any
    images: dict[str, Image] = field(default_factory=dict[str, Image])

    def encode(
        self, rows: Sequence[TrainingRow], input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> VisionBatch:
        """The vision inputs of a batch whose padded ``input_ids``/``attention_mask`` are (N, L)."""
        image_token = processor_token_id(self.processor, "image")
        mrope = MropeIndex.of(self.processor)
        inputs = np.empty(len(rows), dtype=object)
        positions: list[torch.Tensor] = []
        for i, row in enumerate(rows):
            row_inputs = None
            if row.image_urls and not row.is_drop:  # a cut prompt never trains: it stays text
                row_inputs = self._inputs(row)
                valid_ids = input_ids[i][attention_mask[i].bool()]
                _check_placeholders(row, valid_ids, row_inputs, image_token, self.processor)
            inputs[i] = row_inputs
            if mrope is not None:
                grid = None if row_inputs is None else row_inputs.get("image_grid_thw")
                positions.append(mrope.positions(input_ids[i], attention_mask[i], grid))
        return VisionBatch(inputs, torch.stack(positions) if mrope is not None else None)

    def _image(self, row: TrainingRow, url: str) -> Image:
        image = self.images.get(url)
        if image is None:
            try:
                image = load_image(url)
            except (OSError, ValueError) as exc:
                raise InvalidImagesError(
                    f"rollout {row.rollout_id!r} turn {row.images_turn}: cannot load image {_short(url)!r}: {exc}"
                ) from exc
            self.images[url] = image
        return image

    def _inputs(self, row: TrainingRow) -> dict[str, torch.Tensor]:
        images = [self._image(row, url) for url in row.image_urls or ()]
        outputs = self.processor(text=["dummy"], images=images, return_tensors="pt")
        vision = {key: value for key, value in dict(outputs).items() if key not in _TEXT_KEYS}
        if not vision:
            raise InvalidImagesError(
                f"rollout {row.rollout_id!r} turn {row.images_turn}: the processor "
                f"{type(self.processor).__name__} returned no vision tensors for {len(images)} image(s) "
                f"(keys: {sorted(dict(outputs))})"
            )
        return vision


def _check_placeholders(
    row: TrainingRow,
    tokens: torch.Tensor,
    row_inputs: dict[str, torch.Tensor],
    image_token: int | None,
    processor: Any,
) -> None:
    """The row's image placeholder tokens must be exactly what its images expand to."""
    grid = row_inputs.get("image_grid_thw")
    merge_size = getattr(getattr(processor, "image_processor", None), "merge_size", None)
    if image_token is None or grid is None or merge_size is None:
        return  # a processor without Qwen-VL grids: its model checks the count itself
    expected = int(grid.prod(-1).sum()) // int(merge_size) ** 2
    found = int((tokens == image_token).sum())
    if found != expected:
        n_images = len(row.image_urls or ())
        raise InvalidImagesError(
            f"rollout {row.rollout_id!r} turn {row.images_turn}: the row holds {found} image placeholder "
            f"tokens but its {n_images} image(s) expand to {expected}: a response cut at "
            "max_response_length split an image, or the call's images do not belong to its prompt"
        )


__all__ = (
    "MAX_REMOTE_IMAGE_BYTES",
    "MropeIndex",
    "VisionBatch",
    "VisionEncoder",
    "load_image",
    "processor_token_id",
)
