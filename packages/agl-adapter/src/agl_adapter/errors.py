"""The adapter's exceptions; each message names the rollout, the turn or the count, and the fix."""

from __future__ import annotations


class InvalidTraceError(TypeError):
    """A triplet holds ids or log-probs of the wrong type (e.g. floats or strings as token ids).

    Raised with the rollout id and turn index, so the agent or the event conversion that
    produced the trace can be found. Triplets validated by ``agl_types`` never raise this;
    it guards traces built with ``model_construct`` or mutated after validation.
    """


class InvalidRoutesError(ValueError):
    """A model call's MoE routes (R3) cannot be placed under its tokens: not a base64 ``.npy`` of
    expert ids that fit uint8, shorter than the call's tokens, of another model's shape, or missing
    where routing replay needs them. The message names the rollout and the turn."""


class InvalidImagesError(ValueError):
    """Rollouts carry images the adapter cannot encode at all: it has no processor, or the processor
    gives no vision tensors. The message names the rollout and the turn the images come from.
    (A single row whose images cannot be trained on is dropped instead, with a warning.)"""


class EmptyBatchError(RuntimeError):
    """A training step produced zero rows; the message says why (no traces, all rows empty, all dropped)."""


__all__ = ("EmptyBatchError", "InvalidImagesError", "InvalidRoutesError", "InvalidTraceError")
