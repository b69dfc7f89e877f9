"""List-level helpers with the reference's names and conventions (verl: prompts left-padded, responses right-padded).

The adapter's hot path does not use these (it pads whole batches with numpy); they exist for
callers that build single rows by hand and for tests that state the convention plainly.
"""

from __future__ import annotations

from collections.abc import Sequence


def ids_startswith(full_ids: Sequence[int], prefix_ids: Sequence[int]) -> bool:
    """Whether ``full_ids`` begins with ``prefix_ids`` (an empty prefix always matches)."""
    n = len(prefix_ids)
    return len(full_ids) >= n and list(full_ids[:n]) == list(prefix_ids)


def get_left_padded_ids_and_attention_mask(
    ids: Sequence[int], max_length: int, pad_token_id: int
) -> tuple[list[int], list[int]]:
    """Left-pad ``ids`` to ``max_length``; longer input keeps its LAST ``max_length`` ids.

    Returns ``(ids, attention_mask)``, both of length ``max_length``, mask 0 on padding.
    """
    n = len(ids)
    if n >= max_length:
        return list(ids[n - max_length :]), [1] * max_length
    pad = max_length - n
    return [pad_token_id] * pad + list(ids), [0] * pad + [1] * n


def get_right_padded_ids_and_attention_mask(
    ids: Sequence[int], max_length: int, pad_token_id: int
) -> tuple[list[int], list[int]]:
    """Right-pad ``ids`` to ``max_length``; longer input keeps its FIRST ``max_length`` ids.

    Returns ``(ids, attention_mask)``, both of length ``max_length``, mask 0 on padding.
    """
    n = len(ids)
    if n >= max_length:
        return list(ids[:max_length]), [1] * max_length
    pad = max_length - n
    return list(ids) + [pad_token_id] * pad, [1] * n + [0] * pad


__all__ = (
    "get_left_padded_ids_and_attention_mask",
    "get_right_padded_ids_and_attention_mask",
    "ids_startswith",
)
