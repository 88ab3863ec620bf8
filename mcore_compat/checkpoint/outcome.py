"""What a load returns (:class:`LoadedCheckpoint`) and how the ranks agree on a load's outcome (:func:`_agree`):
shared by mcore_compat's own format (:mod:`.load`) and Megatron's dist_checkpointing directories (:mod:`.megatron`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointInProgressError,
    CheckpointMismatchError,
    CheckpointReshardError,
)
from .manifest import Manifest
from .save import _gather

__all__ = ["LoadedCheckpoint"]


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :func:`load_checkpoint` loaded.

    Attributes:
        iteration: the iteration given to ``save_checkpoint`` (``None`` if none was).
        extra: this rank's ``extra`` (the saving rank at the same place in the layout).
        manifest: the checkpoint's manifest (versions, layout, files); ``None`` for a Megatron dist_checkpointing
            directory (:class:`~.megatron.LoadedMegatronCheckpoint`).
        rng_restored: the RNG states were restored (same layout as at save; after a reshard they are not).
        optimizer_loaded: the optimizer's state was loaded.
        checksums_verified: every shard this rank read matched its recorded checksum (``False``: written before
            checksums, nothing to verify; or ``verify=False``).
    """

    iteration: int | None
    extra: dict[str, Any] | None
    manifest: Manifest | None
    rng_restored: bool
    optimizer_loaded: bool
    checksums_verified: bool = False



def _agree(report: tuple[str, str, int] | None, used: set[str] | None = None) -> list[set[str]]:
    """Every rank's outcome of planning; raise the first refusal of another rank (this rank's own failure is
    re-raised by the caller). Returns every rank's ``used`` ids (a PP change, :mod:`.pp`)."""
    gathered = _gather((report, used))
    refused = [r for r, _ in gathered if r is not None]
    if report is not None or not refused:
        return [u for _, u in gathered if u is not None]
    name, message, rank = refused[0]
    text = f"refused on rank {rank}: {message}"
    if name == "CheckpointFormatError":
        raise CheckpointFormatError(text)
    if name == "CheckpointInProgressError":
        raise CheckpointInProgressError(text)
    if name == "CheckpointMismatchError":
        raise CheckpointMismatchError(text)
    if name == "CheckpointReshardError":
        raise CheckpointReshardError(text)
    raise CheckpointError(f"{text} ({name})")
