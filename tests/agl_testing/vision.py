"""A tiny Qwen2-VL processor and model built here (no hub), and images as URLs, for multimodal tests.

The processor is transformers' real ``Qwen2VLProcessor`` (its Qwen2-VL image processor, a BPE
tokenizer with Qwen-VL's vision tokens) without the video processor: transformers builds that one
on torchvision, which has no CPU build for torch 2.13 here (the PyPI wheel breaks transformers'
Qwen2-VL imports against CPU torch). ``get_rope_index`` is bound the way verl's ``hf_processor``
binds it, so the adapter sees what the trainer gives it; unbound, it is the processor a user gets
from ``AutoProcessor.from_pretrained``.
"""

from __future__ import annotations

import base64
import io
import types
from pathlib import Path
from typing import Any

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
PATCH = 14
MERGE = 2


def _tokenizer() -> Any:
    from agl_trainer.local.tiny_model import IM_START, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [IM_START, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]}
    )
    return tokenizer


def _config(tokenizer: Any) -> Any:
    from transformers import Qwen2VLConfig

    ids = tokenizer.convert_tokens_to_ids
    return Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 512,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "bos_token_id": None,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 32,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": 2,
        },
        image_token_id=ids(IMAGE_PAD),
        video_token_id=ids(VIDEO_PAD),
        vision_start_token_id=ids(VISION_START),
        vision_end_token_id=ids(VISION_END),
    )


def tiny_vl_processor(bind_rope_index: bool = True) -> Any:
    """A Qwen2-VL processor whose images are 1 to 4 x 1 to 4 merged patches (28-pixel cells);
    ``bind_rope_index=False`` leaves out what verl's ``hf_processor`` adds (config, get_rope_index)."""
    from transformers import Qwen2VLModel, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        """``Qwen2VLProcessor`` without the torchvision-built video processor (see the module docstring)."""

        def __init__(self, image_processor: Any, tokenizer: Any) -> None:  # pyright: ignore[reportMissingSuperCall]
            self.image_processor, self.tokenizer, self.chat_template = image_processor, tokenizer, None
            self.image_token, self.video_token = IMAGE_PAD, VIDEO_PAD
            self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
            self.video_token_id = tokenizer.convert_tokens_to_ids(VIDEO_PAD)

    tokenizer = _tokenizer()
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=(PATCH * MERGE) ** 2,
        max_pixels=(PATCH * MERGE * 4) ** 2,
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=2,
    )
    processor = ImageOnlyQwen2VLProcessor(image_processor, tokenizer)
    if not bind_rope_index:
        return processor
    processor.config = _config(tokenizer)  # pyright: ignore[reportAttributeAccessIssue]
    processor.get_rope_index = types.MethodType(Qwen2VLModel.get_rope_index, processor)  # pyright: ignore[reportAttributeAccessIssue]
    processor.get_vision_position_ids = types.MethodType(Qwen2VLModel.get_vision_position_ids, processor)  # pyright: ignore[reportAttributeAccessIssue]
    return processor


def tiny_vl_model(processor: Any, seed: int = 0) -> Any:
    """A 2-layer Qwen2-VL with a 1-block vision tower, random weights from ``seed``, in eval mode."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(processor.config).eval()


def png_bytes(cells_wide: int, cells_high: int, shade: int = 0) -> bytes:
    """A PNG the tiny processor turns into ``cells_wide`` x ``cells_high`` merged patches."""
    from PIL import Image

    size = (PATCH * MERGE * cells_wide, PATCH * MERGE * cells_high)
    image = Image.new("RGB", size, ((40 * shade) % 256, (90 + 7 * shade) % 256, 200))
    for x in range(0, size[0], 5):
        image.putpixel((x, x % size[1]), (255, 255, 255))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def png_data_url(cells_wide: int, cells_high: int, shade: int = 0) -> str:
    """:func:`png_bytes` as a ``data:`` URL, as agents inline images in their messages."""
    return "data:image/png;base64," + base64.b64encode(png_bytes(cells_wide, cells_high, shade)).decode()


def png_file_url(folder: Path, cells_wide: int, cells_high: int, shade: int = 0) -> str:
    """:func:`png_bytes` written under ``folder``, as a ``file://`` URL."""
    path = folder / f"image-{cells_wide}x{cells_high}-{shade}.png"
    path.write_bytes(png_bytes(cells_wide, cells_high, shade))
    return f"file://{path}"


def placeholder(processor: Any, cells_wide: int, cells_high: int) -> list[int]:
    """The prompt ids of one image: vision start, one pad token per merged patch, vision end."""
    ids = processor.tokenizer.convert_tokens_to_ids
    return [ids(VISION_START), *[ids(IMAGE_PAD)] * (cells_wide * cells_high), ids(VISION_END)]
