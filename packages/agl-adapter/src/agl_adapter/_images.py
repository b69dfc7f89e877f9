"""Vision-language rows: each row's images → verl's ``multi_modal_inputs`` and mrope ``position_ids``.

A row's images are those of the last model call it holds: that call's messages carry every image
of the row's context, in order. The HF processor (verl's ``hf_processor``) turns them into the
vision tensors the model's forward takes (``pixel_values``, ``image_grid_thw``, ...); for mrope
models every row gets (4, L) position ids, a text row over three vision rows, which is how verl's
engine recognises mrope. A processor is an mrope model's when verl's ``hf_processor`` bound it the
model's ``get_rope_index``, or, unbound, when its class (or its image processor's) is Qwen2/2.5/3-VL
or Qwen3.5's by name, as Agent Lightning 1.0.2 and verl recognise them.

The row's image placeholder tokens are counted against what its images expand to, so images are
never trained under the wrong tokens: a row where they disagree is dropped (``is_drop``) with a
warning naming the rollout and the turn, rather than stopping the run for one rollout.
"""

from __future__ import annotations

import base64
import binascii
import inspect
import io
import itertools
import logging
import urllib.parse
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
logger = logging.getLogger("agl_adapter")

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
        return _open(Path(urllib.request.url2pathname(urllib.parse.urlparse(url).path)).read_bytes())
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


class UnusableImagesError(ValueError):
    """A row's images cannot be trained on (see :meth:`VisionEncoder.encode`); the row is dropped."""


@dataclass(frozen=True)
class VisionBatch:
    """What a batch's images add: per row the vision tensors (None: a row without images) when any row
    has images; (N, 4, L) positions for an mrope model then; the rows dropped for their images."""

    multi_modal_inputs: NDArray[np.object_] | None
    position_ids: torch.Tensor | None
    dropped: tuple[int, ...]


def _text_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """0, 1, ... on the row's tokens and 1 on padding: the text row of verl's mrope layout."""
    valid = attention_mask.bool()
    positions = torch.ones(len(attention_mask), dtype=torch.long)
    positions[valid] = torch.arange(int(valid.sum()))
    return positions


_QWEN_VL_CLASS_TAGS = ("Qwen2VL", "Qwen2_5_VL", "Qwen3VL", "Qwen3_5")
VISION_START = "<|vision_start|>"


def is_qwen_vl_processor(processor: Any) -> bool:
    """Whether the processor (or its image processor) is a Qwen2/2.5/3-VL or Qwen3.5 one, by class
    name, as Agent Lightning 1.0.2 and verl's own helpers recognise an mrope model unbound."""
    names = [type(processor).__name__, type(getattr(processor, "image_processor", None)).__name__]
    return any(tag in name for name in names for tag in _QWEN_VL_CLASS_TAGS)


def qwen_vl_image_positions(
    tokens: torch.Tensor, image_grid_thw: torch.Tensor, image_token: int, vision_start: int, merge_size: int
) -> torch.Tensor:
    """(3, T) Qwen-VL mrope positions (t, h, w) of a row's T unpadded tokens with images.

    An image is its placeholder run after a ``vision_start`` token, one (t, h/merge, w/merge) grid
    row of ``image_grid_thw`` (images, 3) each; its tokens sit at the next free position plus their
    grid index, and text resumes one past the image's largest position (Qwen2-VL, arXiv:2409.12191).
    """
    ids = tokens.tolist()
    n_images = sum(1 for a, b in itertools.pairwise(ids) if a == vision_start and b == image_token)
    pieces: list[torch.Tensor] = []
    cursor, position = 0, 0
    for t, h, w in image_grid_thw[:n_images].tolist():
        first = ids.index(image_token, cursor)
        pieces.append(torch.arange(position, position + first - cursor).expand(3, -1))
        position += first - cursor
        grid = torch.meshgrid(
            torch.arange(t), torch.arange(h // merge_size), torch.arange(w // merge_size), indexing="ij"
        )
        pieces.append(torch.stack(grid).flatten(1) + position)
        position = int(pieces[-1].max()) + 1
        cursor = first + pieces[-1].shape[1]
    pieces.append(torch.arange(position, position + max(len(ids) - cursor, 0)).expand(3, -1))
    return torch.cat(pieces, dim=1)


def _vision_start_token(processor: Any) -> int | None:
    """Qwen3-VL processors name their ``vision_start`` token; Qwen2/2.5-VL ones leave it to the tokenizer."""
    token_id = processor_token_id(processor, "vision_start")
    tokenizer = getattr(processor, "tokenizer", None)
    if token_id is not None or tokenizer is None:
        return token_id
    converted = tokenizer.convert_tokens_to_ids(VISION_START)
    unknown = getattr(tokenizer, "unk_token_id", None)
    return converted if isinstance(converted, int) and converted != unknown else None


@dataclass(frozen=True)
class QwenVLRopeIndex:
    """Qwen-VL vision positions for a processor verl's ``hf_processor`` did not bind ``get_rope_index``
    to (e.g. ``AutoProcessor.from_pretrained`` directly): the processor gives the tokens and merge size."""

    image_token: int
    vision_start: int
    merge_size: int

    @classmethod
    def of(cls, processor: Any, image_token: int | None) -> QwenVLRopeIndex:
        """Raises InvalidImagesError naming the processor class when it lacks what positions need."""
        vision_start = _vision_start_token(processor)
        merge_size = getattr(getattr(processor, "image_processor", None), "merge_size", None)
        if image_token is None or vision_start is None or merge_size is None:
            needed = (
                ("the image token id", image_token),
                (f"the {VISION_START} token id", vision_start),
                ("image_processor.merge_size", merge_size),
            )
            missing = " and ".join(name for name, value in needed if value is None)
            raise InvalidImagesError(
                f"the processor {type(processor).__name__} is a Qwen-VL one without a bound get_rope_index, "
                f"and mrope positions need {missing}: load it with verl's hf_processor "
                "(verl.utils.tokenizer.hf_processor), which binds the model's get_rope_index"
            )
        return cls(image_token, vision_start, int(merge_size))

    def vision_rows(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_grid_thw: torch.Tensor
    ) -> torch.Tensor:
        """(3, L) for one padded row: the image positions on its tokens, 1 on padding."""
        valid = attention_mask.bool()
        rows = torch.ones(3, len(input_ids), dtype=torch.long)
        rows[:, valid] = qwen_vl_image_positions(
            input_ids[valid], image_grid_thw, self.image_token, self.vision_start, self.merge_size
        )
        return rows


@dataclass(frozen=True)
class BoundRopeIndex:
    """A model's ``get_rope_index``, bound to its processor by verl's ``hf_processor``."""

    rope_index: Callable[..., Any]
    image_token: int | None
    takes_type_ids: bool
    """transformers >= 5.3 finds the images by ``mm_token_type_ids`` rather than by token id."""

    def vision_rows(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_grid_thw: torch.Tensor
    ) -> torch.Tensor:
        """(3, L) for one padded row, as the bound method gives it."""
        kwargs: dict[str, Any] = {
            "input_ids": input_ids[None],
            "attention_mask": attention_mask[None],
            "image_grid_thw": image_grid_thw,
            "video_grid_thw": None,
        }
        if self.takes_type_ids:
            is_image = (
                input_ids == self.image_token if self.image_token is not None else torch.zeros_like(input_ids)
            )
            kwargs["mm_token_type_ids"] = (is_image.long() * _IMAGE_TYPE)[None]
        result = self.rope_index(**kwargs)
        vision = result[0] if isinstance(result, tuple) else result  # (3, 1, L)
        return vision[:, 0, :].to(torch.long)


@dataclass(frozen=True)
class MropeIndex:
    """How a batch's mrope positions are built: the processor's bound ``get_rope_index`` (verl's
    ``hf_processor``) or, for a Qwen-VL processor without one, :class:`QwenVLRopeIndex`."""

    vision: BoundRopeIndex | QwenVLRopeIndex

    @classmethod
    def of(cls, processor: Any, image_token: int | None) -> MropeIndex | None:
        """None for a processor of a model without mrope (its rows keep (N, L) positions)."""
        rope_index = getattr(processor, "get_rope_index", None)
        if rope_index is not None:
            takes_type_ids = "mm_token_type_ids" in inspect.signature(rope_index).parameters
            return cls(BoundRopeIndex(rope_index, image_token, takes_type_ids))
        if is_qwen_vl_processor(processor):
            return cls(QwenVLRopeIndex.of(processor, image_token))
        return None

    def positions(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_grid_thw: torch.Tensor | None
    ) -> torch.Tensor:
        """(4, L): the text row over the model's three vision rows; a row without images (None) is
        text on all four, as get_rope_index gives a text-only row."""
        text = _text_positions(attention_mask)
        if image_grid_thw is None:
            return text.expand(4, -1).clone()
        return torch.cat([text[None], self.vision.vision_rows(input_ids, attention_mask, image_grid_thw)])


@dataclass
class VisionEncoder:
    """Runs ``processor`` on rows' images; loaded images are kept by URL for the batch being built."""

    processor: Any
    images: dict[str, Image] = field(default_factory=dict[str, Image])

    def encode(
        self, rows: Sequence[TrainingRow], input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> VisionBatch:
        """The vision inputs of a batch whose padded ``input_ids``/``attention_mask`` are (N, L).

        A row that would train images under the wrong tokens is dropped, with a warning naming the
        rollout, the turn and why: an image that does not load, or image placeholder tokens that are
        not what the row's images expand to (a response cut through an image, images missing from
        the row, a processor configured otherwise than the server's). A row whose prompt was cut
        never trains (``is_drop``) and is left as text, as the reference does.
        """
        image_token = processor_token_id(self.processor, "image")
        found = (input_ids == image_token).sum(-1).tolist() if image_token is not None else None
        has_images = any(row.image_urls for row in rows)
        inputs = np.full(len(rows), None, dtype=object)
        dropped: list[int] = []
        for i, row in enumerate(rows):
            if row.is_drop:
                continue
            try:
                inputs[i] = self._inputs(row) if row.image_urls else None
                self._check_placeholders(row, inputs[i], None if found is None else found[i])
            except UnusableImagesError as exc:
                logger.warning("rollout %r turn %d: row dropped: %s", row.rollout_id, row.images_turn, exc)
                inputs[i] = None
                dropped.append(i)
        mrope = MropeIndex.of(self.processor, image_token) if has_images else None
        positions = None
        if mrope is not None:
            grids = [
                None if row_inputs is None else row_inputs.get("image_grid_thw") for row_inputs in inputs
            ]
            positions = torch.stack(
                [mrope.positions(input_ids[i], attention_mask[i], grid) for i, grid in enumerate(grids)]
            )
        return VisionBatch(inputs if has_images else None, positions, tuple(dropped))

    def _image(self, url: str) -> Image:
        image = self.images.get(url)
        if image is None:
            try:
                image = load_image(url)
            except (OSError, ValueError, PIL.Image.DecompressionBombError) as exc:
                raise UnusableImagesError(f"cannot load image {_short(url)!r}: {exc}") from exc
            self.images[url] = image
        return image

    def _inputs(self, row: TrainingRow) -> dict[str, torch.Tensor]:
        images = [self._image(url) for url in row.image_urls or ()]
        outputs = self.processor(text=["dummy"], images=images, return_tensors="pt")
        vision = {key: value for key, value in dict(outputs).items() if key not in _TEXT_KEYS}
        if not vision:
            raise InvalidImagesError(
                f"rollout {row.rollout_id!r} turn {row.images_turn}: the processor "
                f"{type(self.processor).__name__} returned no vision tensors for {len(images)} image(s) "
                f"(keys: {sorted(dict(outputs))}): it is not a vision-language model's processor"
            )
        return vision

    def _check_placeholders(
        self, row: TrainingRow, row_inputs: dict[str, torch.Tensor] | None, found: int | None
    ) -> None:
        """The row's image placeholder tokens must be exactly what its images expand to (none
        without images); a processor without Qwen-VL grids leaves the count to its model."""
        if found is None:
            return
        expected = 0
        if row_inputs is not None:
            grid = row_inputs.get("image_grid_thw")
            merge_size = getattr(getattr(self.processor, "image_processor", None), "merge_size", None)
            if grid is None or merge_size is None:
                return
            expected = int(grid.prod(-1).sum()) // int(merge_size) ** 2
        if found != expected:
            n_images = len(row.image_urls or ())
            raise UnusableImagesError(
                f"its tokens hold {found} image placeholder tokens, its {n_images} image(s) expand to "
                f"{expected}: a response cut at max_response_length through an image, images missing "
                "from the call's request, or a processor with other image sizes than the server's"
            )


__all__ = (
    "MAX_REMOTE_IMAGE_BYTES",
    "BoundRopeIndex",
    "MropeIndex",
    "QwenVLRopeIndex",
    "UnusableImagesError",
    "VisionBatch",
    "VisionEncoder",
    "load_image",
    "is_qwen_vl_processor",
    "processor_token_id",
    "qwen_vl_image_positions",
)
