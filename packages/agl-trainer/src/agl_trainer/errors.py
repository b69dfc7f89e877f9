"""Errors that end a run on purpose, each said in one line by ``agl-trainer`` (importing this
module loads nothing else: the CLI catches them before verl is imported)."""


class TooManyEmptySteps(RuntimeError):
    """``agentlightning.max_empty_steps`` consecutive steps trained nothing."""


class CheckpointStateMismatch(ValueError):
    """agl's state in a checkpoint folder belongs to another step than the checkpoint's."""


class ServerSetupError(ValueError):
    """An inference server is set up in a way agl cannot train with (e.g. LoRA on several API servers)."""


__all__ = ("CheckpointStateMismatch", "ServerSetupError", "TooManyEmptySteps")
