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
(one entry per chunk, :mod:`.pp`), in :attr:`Manifest.pipeline`. And :data:`CHECKSUMS` (absent before
checksums: nothing to verify then) holds per shard the checksum of the file and of each host tensor in it
(:mod:`.files`): ``{"algorithm": "xxh3_64", "shards": {name: {"file": hex, "tensors": {path: hex}}}}``, in
:attr:`Manifest.checksums`.

A save writes into a hidden sibling directory (:func:`.files.stage_name`) and renames it to the checkpoint's name
when complete, so a checkpoint directory is complete or absent. The marker (``.mcore_compat_writing``) is created
in the staging directory before anything else and removed before the rename. A checkpoint directory with the marker
was written in place by an mcore_compat before atomic saves (or copied from a staging directory):
:func:`read_manifest` reports whether its writer is alive, gone, or cannot be told.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import CheckpointFormatError, CheckpointInProgressError
from .files import old_name, stage_name

__all__ = ["CHECKSUMS", "FORMAT", "FORMAT_VERSION", "MANIFEST", "MARKER", "STALE_AFTER_S", "Manifest", "ShardFile",
           "marker_state", "read_manifest", "shard_name", "write_json"]

#: The format this module writes: per-rank torch files of plain tensors and Python values (``torch.load``
#: with ``weights_only=True`` reads them), optimizer state stored per model parameter and flattened range.
FORMAT = "mcore_compat.torch"
FORMAT_VERSION = 1
MANIFEST = "mcore_compat_checkpoint.json"
MARKER = ".mcore_compat_writing"
TP_RECORD = "mcore_compat_tensor_parallel.json"
PP_RECORD = "mcore_compat_pipeline.json"
CHECKSUMS = "mcore_compat_checksums.json"
#: A marker written on another host (whose pid cannot be checked from here) counts as left by a dead writer once it
#: is older than this (seconds).
STALE_AFTER_S = 6 * 3600


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
    checksums: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def layout_text(self) -> str:
        lay = self.layout
        return (f"TP={lay['tp']} PP={lay['pp']} DP={lay['dp']} EP={lay['ep']} VPP={lay['vpp']} "
                f"(world {lay['world']})")


def write_json(path: Path, data: dict[str, Any], durable: bool = False) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file renamed over it; fsynced first when ``durable``)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(data, indent=1, sort_keys=True))
        if durable:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)


def marker_data() -> dict[str, Any]:
    """What a marker records: the writer's pid and host, and when it started."""
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def marker_state(marker: Path) -> tuple[str, str]:
    """``(state, by)`` of a marker file: ``state`` is ``"alive"`` (its writer runs on this host), ``"gone"`` (its
    pid is not alive on this host, or it is older than :data:`STALE_AFTER_S`) or ``"unknown"`` (another host,
    recent or undated); ``by`` names the writer."""
    try:
        who = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "unknown", ""
    if not isinstance(who, dict):
        return "unknown", ""
    by = f" by pid {who.get('pid')} on {who.get('host')} since {who.get('started')}"
    pid = who.get("pid")
    if who.get("host") == socket.gethostname() and isinstance(pid, int):
        return ("alive" if _pid_alive(pid) else "gone"), by
    try:
        started = datetime.datetime.fromisoformat(str(who.get("started")))
        age = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()
    except (ValueError, TypeError):
        return "unknown", by
    return ("gone" if age > STALE_AFTER_S else "unknown"), by


def _complete_in_place(root: Path) -> bool:
    """A directory with a marker whose manifest and shards (at their recorded sizes) are all there: the save
    finished writing and was stopped while removing the marker."""
    try:
        data = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
        return all((root / f["name"]).is_file() and (root / f["name"]).stat().st_size == f["bytes"]
                   for f in data["files"])
    except (OSError, ValueError, TypeError, KeyError):
        return False


def _marker_error(root: Path) -> CheckpointInProgressError:
    state, by = marker_state(root / MARKER)
    if state == "alive":
        return CheckpointInProgressError(f"the checkpoint at {root} is being written{by} ({MARKER} is there): "
                                         "wait for the save to finish")
    if _complete_in_place(root):
        advice = (f"its manifest and every shard are there at their recorded sizes (the save was stopped while "
                  f"removing {MARKER}): remove only the file {root / MARKER} to load it")
    else:
        advice = ("it holds no complete checkpoint (no manifest or a shard missing or short): load an earlier "
                  "checkpoint, or save to this path again")
    if state == "gone":
        return CheckpointInProgressError(f"the save to {root} was interrupted (writer{by} is gone): {advice}")
    return CheckpointInProgressError(
        f"the checkpoint at {root} is being written{by} ({MARKER} is there; that writer runs on another host and "
        f"is counted as gone after {STALE_AFTER_S // 3600} h): wait for the save to finish; if the writer is gone, "
        f"{advice}")


def _missing_hint(root: Path) -> str:
    """Why ``root`` is not there: a save to it was interrupted (its staging or old directory is beside it)."""
    stage, old = stage_name(root), old_name(root)
    if old.is_dir():
        return (f": a save to it was interrupted while publishing; the previous checkpoint is at {old}"
                + (f", the new one at {stage}" if stage.is_dir() else "")
                + f" (rename the one to keep to {root.name})")
    if stage.is_dir():
        return f": a save to it was interrupted before it was complete (its partial files are in {stage})"
    return ": not a directory"


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
        raise CheckpointFormatError(f"no checkpoint at {root}{_missing_hint(root)}")
    if (root / MARKER).exists():
        raise _marker_error(root)
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
        sums = root / CHECKSUMS
        if sums.is_file():
            data["checksums"] = json.loads(sums.read_text(encoding="utf-8"))
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
    ``tensor_parallel``, ``pipeline`` and ``checksums`` (written to :data:`TP_RECORD`, :data:`PP_RECORD` and
    :data:`CHECKSUMS`)."""
    data = Manifest(**kwargs).to_json()
    data.pop("tensor_parallel", None)
    data.pop("pipeline", None)
    data.pop("checksums", None)
    return data
