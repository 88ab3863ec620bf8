"""The errors of :mod:`mcore_compat.checkpoint`: each refusal happens before anything is written into the model or
the optimizer, and its message names what is wrong and what to do instead."""

from __future__ import annotations

from ..errors import McoreCompatError

__all__ = ["CheckpointError", "CheckpointFormatError", "CheckpointInProgressError", "CheckpointMismatchError",
           "CheckpointReshardError"]


class CheckpointError(McoreCompatError):
    """A checkpoint cannot be saved or loaded; nothing was loaded into the model or the optimizer."""


class CheckpointFormatError(CheckpointError):
    """The directory is not a complete mcore_compat checkpoint: no manifest (a foreign or empty directory), a
    manifest of another format, a missing or truncated shard file."""


class CheckpointInProgressError(CheckpointError):
    """Another process is writing the checkpoint (its marker file is there), or a writer died before finishing."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the model or optimizer it is loaded into (names, shapes, dtypes, params)."""


class CheckpointReshardError(CheckpointError):
    """The checkpoint was saved with a parallel layout this format cannot convert to the one it is loaded into."""
