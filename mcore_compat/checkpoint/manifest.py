"""The checkpoint's manifest (``mcore_compat_checkpoint.json``) and its in-progress marker.

A checkpoint directory holds one ``rank_<global rank>.pt`` per rank and the manifest, written last by rank 0:
the format, the mcore_compat / megatron-core / torch versions that wrote it, the parallel layout (TP, PP, DP, EP,
virtual stages), whether it holds optimizer and scheduler state, and every shard file with its coordinates and size.
Beside it, :data:`TP_RECORD` (absent from checkpoints written before TP resharding; a file of its own, so that an
mcore_compat that predates it still reads the manifest) says per pipeline stage how each parameter is split over
TP: ``{"pp<rank>": {"<chunk>.<param name>": [partition dim, stride]}}``, dim ``-1`` when duplicated (:mod:`.tp`);
:func:`read_manifest` puts it in :attr:`Manifest.tensor_parallel`. Likewise :data:`PP_RECORD` (absent before PP
resharding) says per pipeline stage where each transformer layer sits and which weight is the tied embedding:
``{"pp<rank>": [{"layers": {module name: global layer_number}, "tied": name, "share": bool, "num_layers": int}]}``
(one entry per chunk, :mod:`.pp`), in :attr:`Manifest.pipeline`.
The marker (``.mcore_compat_writing``) is created before anything else is written and removed after the
manifest: a directory with the marker is being written (or its writer died), one without a manifest is no
checkpoint of ours.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import CheckpointFormatError, CheckpointInProgressError

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "MARKER", "Manifest", "ShardFile", "read_manifest",
           "shard_name", "write_json"]

#: The format this module writes: per-rank torch files of plain tensors and Python values (``torch.load``
#: with ``weights_only=True`` reads them), optimizer state stored per model parameter and flattened range.
FORMAT = "mcore_compat.torch"
FORMAT_VERSION = 1
MANIFEST = "mcore_compat_checkpoint.json"
MARKER = ".mcore_compat_writing"
TP_RECORD = "mcore_compat_tensor_parallel.json"
PP_RECORD = "mcore_compat_pipeline.json"


def shard_name(rank: int) -> str:
    """The file name of global rank ``rank``'s shard."""
    return f"rank_{rank:05d}.pt"


@dataclass(frozen=True)
class ShardFile:
    """One rank's file: its name, byte size and the rank's coordinates (see :class:`.coords.Coords`)."""

    name: str
    bytes: int
    coords: dict[str, int]


@dataclass(frozen=True)
class Manifest:
    """What :func:`read_manifest` found (see the module docstring)."""

    format: str
    format_version: int
    mcore_compat: str
    megatron_core: str
    torch: str
    layout: dict[str, int]
    distributed_optimizer: bool
    has_optimizer: bool
    has_scheduler: bool
    iteration: int | None
    files: list[ShardFile] = field(default_factory=list)
    optimizer_format: str = "per-param"
    tensor_parallel: dict[str, dict[str, list[int]]] | None = None
    pipeline: dict[str, list[dict[str, Any]]] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def layout_text(self) -> str:
        lay = self.layout
        return (f"TP={lay['tp']} PP={lay['pp']} DP={lay['dp']} EP={lay['ep']} VPP={lay['vpp']} "
                f"(world {lay['world']})")


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


def _foreign_hint(path: Path) -> str:
    if (path / "metadata.json").is_file() or (path / "common.pt").is_file():
        return (" It looks like a Megatron dist_checkpointing checkpoint (metadata.json / common.pt): load it with "
                "megatron.core.dist_checkpointing on a release that reads its format")
    if not any(path.iterdir()):
        return " The directory is empty"
    return ""


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The manifest of the checkpoint at ``path``, after checking that it is complete.

    Raises:
        CheckpointFormatError: no such directory, no manifest (a foreign or unfinished directory), an unreadable
            manifest or one of another format, a shard file missing or of another size than written.
        CheckpointInProgressError: the in-progress marker is there.
    """
    root = Path(path)
    if not root.is_dir():
        raise CheckpointFormatError(f"no checkpoint at {root}: not a directory")
    marker = root / MARKER
    if marker.exists():
        try:
            who = json.loads(marker.read_text(encoding="utf-8"))
            by = f" by pid {who.get('pid')} on {who.get('host')} since {who.get('started')}"
        except (OSError, ValueError):
            by = ""
        raise CheckpointInProgressError(
            f"the checkpoint at {root} is being written{by} ({MARKER} is there): wait for the save to finish; if "
            f"that writer is gone, the checkpoint is incomplete - save it again or delete the directory")
    manifest = root / MANIFEST
    if not manifest.is_file():
        raise CheckpointFormatError(f"{root} is not an mcore_compat checkpoint: no {MANIFEST}.{_foreign_hint(root)}")
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
        data["files"] = [ShardFile(**f) for f in data["files"]]
        record = root / TP_RECORD
        if record.is_file():
            data["tensor_parallel"] = json.loads(record.read_text(encoding="utf-8"))
        stages = root / PP_RECORD
        if stages.is_file():
            data["pipeline"] = json.loads(stages.read_text(encoding="utf-8"))
        found = Manifest(**data)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise CheckpointFormatError(f"unreadable {MANIFEST} in {root}: {exc}") from None
    if found.format != FORMAT or found.format_version > FORMAT_VERSION:
        raise CheckpointFormatError(
            f"{root} holds format {found.format!r} version {found.format_version}; this mcore_compat reads "
            f"{FORMAT!r} up to version {FORMAT_VERSION} (upgrade mcore_compat to the one that wrote it: "
            f"{found.mcore_compat})")
    for shard in found.files:
        file = root / shard.name
        if not file.is_file():
            raise CheckpointFormatError(f"checkpoint {root} is missing shard {shard.name} (rank {shard.coords['rank']}"
                                        f" of {found.layout['world']}): copy the whole directory")
        size = file.stat().st_size
        if size != shard.bytes:
            raise CheckpointFormatError(f"shard {file} has {size} bytes, the manifest says {shard.bytes}: truncated "
                                        "or overwritten; copy the whole directory again")
    return found


def manifest_dict(**kwargs: Any) -> dict[str, Any]:
    """A manifest's JSON dict from :class:`Manifest`'s fields (``files`` as :class:`ShardFile`), without
    ``tensor_parallel`` and ``pipeline`` (written to :data:`TP_RECORD` and :data:`PP_RECORD`)."""
    data = Manifest(**kwargs).to_json()
    data.pop("tensor_parallel", None)
    data.pop("pipeline", None)
    return data
