"""The list helpers keep verl's convention: prompts left-padded, responses right-padded."""

from __future__ import annotations

from agl_adapter import (
    get_left_padded_ids_and_attention_mask,
    get_right_padded_ids_and_attention_mask,
    ids_startswith,
)


def test_ids_startswith_matches_exact_prefixes_only() -> None:
    assert ids_startswith([1, 2, 3], [1, 2])
    assert ids_startswith([1, 2, 3], [])
    assert ids_startswith([1, 2], [1, 2])
    assert not ids_startswith([1, 2], [1, 2, 3])
    assert not ids_startswith([1, 3, 3], [1, 2])


def test_left_padding_puts_pads_first_and_masks_them() -> None:
    assert get_left_padded_ids_and_attention_mask([5, 6], 4, 0) == ([0, 0, 5, 6], [0, 0, 1, 1])


def test_left_padding_of_overlong_ids_keeps_the_tail() -> None:
    assert get_left_padded_ids_and_attention_mask([1, 2, 3, 4, 5], 3, 0) == ([3, 4, 5], [1, 1, 1])


def test_right_padding_puts_pads_last_and_masks_them() -> None:
    assert get_right_padded_ids_and_attention_mask([5, 6], 4, 9) == ([5, 6, 9, 9], [1, 1, 0, 0])


def test_right_padding_of_overlong_ids_keeps_the_head() -> None:
    assert get_right_padded_ids_and_attention_mask([1, 2, 3, 4, 5], 3, 9) == ([1, 2, 3], [1, 1, 1])
