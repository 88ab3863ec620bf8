"""``save_checkpoint``: every rank writes its shard; rank 0 writes the manifest last.

Order on disk: the in-progress marker, an older checkpoint's manifest and shards removed, every rank's shard
(written to a temporary name and renamed), the manifest, the marker removed. A reader therefore sees either a
complete checkpoint or the marker (:class:`~.errors.CheckpointInProgressError`), never a mix of two saves.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from pathlib import Path
from typing import Any

import torch

from .._version import __version__
from .coords import Coords, coords
from .errors import CheckpointError
from .manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    MARKER,
    PP_RECORD,
    TP_RECORD,
    ShardFile,
    manifest_dict,
    shard_name,
    write_json,
)
from .pp import stage_record
from .state import capture_rng, check_plain, model_state, optimizer_state
from .tp import split_record

__all__ = ["save_checkpoint"]


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _gather(obj: Any) -> list[Any]:
    dist = _dist()
    if dist is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _barrier() -> None:
    dist = _dist()
    if dist is not None:
        dist.barrier()


def _start(root: Path) -> None:
    """Rank 0: create the directory, the marker, and remove what an earlier save left there."""
    root.mkdir(parents=True, exist_ok=True)
    write_json(root / MARKER, {"pid": os.getpid(), "host": socket.gethostname(),
                               "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
    (root / MANIFEST).unlink(missing_ok=True)
    for old in root.glob("rank_*.pt"):
        old.unlink()


def _version() -> str:
    from ..detect import detect

    try:
        return str(detect().version)
    except Exception:  # no readable megatron-core: recorded as unknown
        return "unknown"


def _distributed_optimizer(chunks: list[Any]) -> bool:
    """Whether DDP was built for the distributed optimizer: ``ddp_config.use_distributed_optimizer`` from 0.7,
    DDP's own ``use_distributed_optimizer`` attribute on 0.4-0.6 (distributed/distributed_data_parallel.py)."""
    return any(getattr(getattr(c, "ddp_config", None), "use_distributed_optimizer",
                       getattr(c, "use_distributed_optimizer", False)) for c in chunks)


def _tensor_parallel(entries: list[dict[str, Any]]) -> dict[str, dict[str, list[int]]]:
    """The manifest's ``tensor_parallel``: per pipeline stage (``"pp<rank>"``), the split record
    (:func:`.tp.split_record`) of its first TP / DP / EP rank (the others hold the same names and splits); taken out
    of ``entries``."""
    out: dict[str, dict[str, list[int]]] = {}
    for e in entries:
        out.setdefault(f"pp{e['coords']['pp']}", {}).update(e.pop("splits"))
    return out


def _pipeline(entries: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The pipeline record (:data:`~.manifest.PP_RECORD`): per stage (``"pp<rank>"``), where its layers sit
    (:func:`.pp.stage_record`, sent by the stage's first TP / DP / EP rank); taken out of ``entries``."""
    out: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        stage = e.pop("stage")
        if stage is not None:
            out[f"pp{e['coords']['pp']}"] = stage
    return out


def _without_crc32() -> contextlib.AbstractContextManager[Any]:
    """``torch.save`` without the zip entries' CRC32 while the shard is written, where torch has the switch
    (``torch.utils.serialization.config.save.compute_crc32``, torch 2.6+; older torch: unchanged).

    torch's reader never checks that checksum (PyTorch builds miniz with ``MINIZ_DISABLE_ZIP_READER_CRC32_CHECKS``),
    so the file loads the same with any torch; computing it is most of ``torch.save``'s time for tensors already in
    host memory (a 0.29 GB shard: 0.23 s with it, 0.07 s without, on a CPU of the CI machine). The shard's size is
    checked against the manifest on load. It is a process-wide setting: another thread's ``torch.save`` during
    the save is written without the checksum too.
    """
    try:
        from torch.utils.serialization import config
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(getattr(config, "save", None), "compute_crc32"):
        return contextlib.nullcontext()
    return config.patch({"save.compute_crc32": False})  # type: ignore[attr-defined]


def _payload(chunks: list[Any], optimizer: Any, scheduler: Any, extra: Any, iteration: int | None,
             where: Coords) -> dict[str, Any]:
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "coords": where.as_dict(),
            "model": model_state(chunks),
            "optimizer": None if optimizer is None else optimizer_state(chunks, optimizer, where),
            "scheduler": None if scheduler is None else scheduler.state_dict(),
            "rng": capture_rng(), "iteration": iteration, "extra": extra}


def save_checkpoint(path: str | os.PathLike[str], chunks: Any, optimizer: Any = None, *, scheduler: Any = None,
                    extra: dict[str, Any] | None = None, iteration: int | None = None) -> Path:
    """Save the model chunks, optimizer, scheduler, RNG states, ``iteration`` and ``extra`` to the directory
    ``path`` (created; an earlier checkpoint there is replaced). Call it on every rank, between steps.

    The format (``mcore_compat.torch``, :mod:`.manifest`) is the same on every release 0.4 ... 0.19: per-rank
    torch files of plain tensors, the optimizer's main params and moments stored per model parameter and
    flattened range, so that a load reshards them over data-parallel size and reads them on another release; the
    manifest records each parameter's split over TP (:mod:`.tp`) and each stage's transformer layer numbers
    (:mod:`.pp`), so that a load reshards over TP or PP size too.

    Args:
        path: the checkpoint directory (on a filesystem every rank sees).
        chunks: the DDP-wrapped model chunk, or the list of them (virtual pipeline stages).
        optimizer: the Megatron optimizer (chained or not; mcore_compat's on 0.4/0.5) or ``None`` (weights only).
        scheduler: an object with ``state_dict()``/``load_state_dict()`` (Megatron's OptimizerParamScheduler).
        extra: a dict of tensors and plain Python values (str, int, float, bool, None, lists and dicts of them),
            each rank's own.
        iteration: the training iteration, returned by :func:`~.load.load_checkpoint`.

    Returns:
        The checkpoint directory.

    Raises:
        CheckpointError: ``extra`` holds something the weights-only loader cannot read, the optimizer's state
            cannot be read (a precision-aware optimizer), a rank failed to write (raised on every rank; the marker
            stays, so the directory reads as unfinished).
    """
    chunk_list = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    if extra is not None:
        check_plain(extra)
    root = Path(path)
    where = coords(len(chunk_list))
    if where.rank == 0:
        _start(root)
    _barrier()
    entry: dict[str, Any] | str
    try:
        file = root / shard_name(where.rank)
        tmp = file.with_name(file.name + ".tmp")
        payload = _payload(chunk_list, optimizer, scheduler, extra, iteration, where)
        with _without_crc32():
            torch.save(payload, tmp)
        del payload
        os.replace(tmp, file)
        first = where.tp == where.dp == where.ep == 0  # one rank per pipeline stage sends its record
        entry = {"name": file.name, "bytes": file.stat().st_size, "coords": where.as_dict(),
                 "splits": split_record(chunk_list) if first else {},
                 "stage": stage_record(chunk_list) if first else None}
    except Exception as exc:  # every rank must learn of it, or the others would wait forever
        entry = f"rank {where.rank}: {type(exc).__name__}: {exc}"
    entries = _gather(entry)
    failed = [e for e in entries if isinstance(e, str)]
    if failed:
        raise CheckpointError(f"saving {root} failed on {len(failed)} rank(s): {failed[0]}")
    if where.rank == 0:
        write_json(root / TP_RECORD, _tensor_parallel([e for e in entries if isinstance(e, dict)]))
        write_json(root / PP_RECORD, _pipeline([e for e in entries if isinstance(e, dict)]))
        write_json(root / MANIFEST, manifest_dict(
            format=FORMAT, format_version=FORMAT_VERSION, mcore_compat=__version__, megatron_core=_version(),
            torch=torch.__version__, layout=where.layout(), distributed_optimizer=_distributed_optimizer(chunk_list),
            has_optimizer=optimizer is not None, has_scheduler=scheduler is not None, iteration=iteration,
            files=[ShardFile(**e) for e in entries]))
        (root / MARKER).unlink()
    _barrier()
    return root
