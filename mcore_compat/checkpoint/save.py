"""``save_checkpoint``: every rank writes its shard into a staging directory; rank 0 writes the manifest and
publishes the checkpoint with one rename.

Order on disk: a hidden staging sibling (:func:`.files.stage_name`) with the in-progress marker; every rank's
shard (written to a temporary name, hashed as written, fsynced, renamed); the records, the checksums and the
manifest (fsynced); the marker removed and the directory fsynced; then the staging directory renamed to the
checkpoint's name (an older checkpoint there swapped out and removed only after that, :func:`.files.publish`) and
the parent directory fsynced. A killed or failed save therefore leaves the previous checkpoint at ``path`` as it
was, and a reader never sees a mix of two saves. ``save_checkpoint_async`` does the same with the shard written
by a thread of each rank after the state is copied to host memory; its handle's ``wait`` (collective) publishes. Every error on any rank (before the first shard too: a path that
is a file, permission denied, a full disk) is agreed by all ranks and raised on each as one line naming the rank
and the cause; the staging directory is removed then.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .._version import __version__
from .coords import Coords, coords
from .errors import CheckpointError
from .files import ALGORITHM, HashingWriter, describe, fsync_dir, publish, stage_name, tensor_checksums
from .manifest import (
    CHECKSUMS,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    MARKER,
    PP_RECORD,
    TP_RECORD,
    ShardFile,
    manifest_dict,
    marker_data,
    marker_state,
    shard_name,
    write_json,
)
from .pp import stage_record
from .state import capture_rng, check_plain, host_copy, model_state, optimizer_state
from .tp import split_record

__all__ = ["SaveHandle", "save_checkpoint", "save_checkpoint_async", "wait_for_pending"]


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    """This rank in the job's collectives (0 in a single process)."""
    dist = _dist()
    return 0 if dist is None else dist.get_rank()


def _gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (collective). A rank that died or stopped answering (the process group's error, e.g.
    gloo's "Connection closed by peer", NCCL's timeout) is raised as a :class:`CheckpointError` naming it."""
    from ..launch import gather_objects

    try:
        return gather_objects(obj)
    except RuntimeError as exc:  # torch.distributed.DistBackendError is one
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise CheckpointError(f"rank {_rank()}: the other ranks stopped answering - a rank died or hangs "
                              f"({first})") from exc


#: What a checkpoint directory may hold; a save refuses to replace a directory holding anything else.
_OURS = (MANIFEST, MARKER, TP_RECORD, PP_RECORD, CHECKSUMS)


def _start(root: Path, durable: bool) -> Path:
    """Rank 0: check ``root`` can be replaced, create the staging directory with the marker; returns it."""
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(20, "not a directory", str(root))
    if root.is_dir():
        foreign = sorted(p.name for p in root.iterdir()
                         if not (p.name in _OURS or p.name.startswith("rank_") or p.name.endswith(".tmp")))
        if foreign:
            raise CheckpointError(f"{root} holds files that are not part of an mcore_compat checkpoint "
                                  f"({', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}); a save replaces "
                                  "the whole directory: save to a new or empty directory")
    stage = stage_name(root)
    if stage.exists():  # left by an earlier save: removed unless its writer still runs on this host
        state, by = marker_state(stage / MARKER)
        if state == "alive" and (stage / MARKER).exists():
            raise CheckpointError(f"another save to {root} is running{by} (its staging directory {stage} is there):"
                                  " wait for it, or save elsewhere")
        shutil.rmtree(stage)
    root.parent.mkdir(parents=True, exist_ok=True)
    stage.mkdir()
    write_json(stage / MARKER, marker_data(), durable)
    return stage


def _needed(payload: Any) -> int:
    """The bytes of the tensors in ``payload`` (about what its shard needs on disk)."""
    if isinstance(payload, torch.Tensor):
        return payload.untyped_storage().nbytes() if payload.numel() else 0
    if isinstance(payload, dict):
        return sum(_needed(v) for v in payload.values())
    if isinstance(payload, (list, tuple)):
        return sum(_needed(v) for v in payload)
    return 0


def _peer_lost(what: str, exc: CheckpointError, kept: bool) -> CheckpointError:
    """The one line for ``what`` failing because a peer stopped answering (``kept``: nothing was published)."""
    return CheckpointError(f"{what} failed: {exc}" + ("; the previous checkpoint there is unchanged" if kept else ""))


def _agree(what: str, status: str | None, kept: bool = False) -> None:
    """Raise on every rank the first rank's failure of ``what`` (``status``: this rank's one-line failure);
    ``kept``: a save's exchange before anything is published (a dead peer's error says the previous checkpoint
    is unchanged)."""
    try:
        gathered = _gather(status)
    except CheckpointError as exc:
        raise _peer_lost(what, exc, kept) from exc
    failed = [s for s in gathered if s is not None]
    if failed:
        raise CheckpointError(f"{what} failed on {len(failed)} rank(s): {failed[0]}")


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
                    extra: dict[str, Any] | None = None, iteration: int | None = None,
                    unsafe_skip_fsync: bool = False) -> Path:
    """Save the model chunks, optimizer, scheduler, RNG states, ``iteration`` and ``extra`` to the directory
    ``path``. Call it on every rank, between steps.

    Atomic and durable: the checkpoint is written into a hidden sibling directory, every shard, record and the
    manifest fsynced, and published with one rename; an earlier checkpoint at ``path`` is removed only after the
    new one is complete and on disk, so a killed or failed save leaves it loadable as it was. Each shard's and each
    host tensor's checksum (XXH3-64) is recorded and verified by :func:`~.load.load_checkpoint`.

    The format (``mcore_compat.torch``, :mod:`.manifest`) is the same on every release 0.4 ... 0.19: per-rank
    torch files of plain tensors, the optimizer's main params and moments stored per model parameter and
    flattened range, so that a load reshards them over data-parallel size and reads them on another release; the
    manifest records each parameter's split over TP (:mod:`.tp`) and each stage's transformer layer numbers
    (:mod:`.pp`), so that a load reshards over TP or PP size too.

    A background save still running (:func:`save_checkpoint_async`) is completed first.

    Args:
        path: the checkpoint directory (on a filesystem every rank sees).
        chunks: the DDP-wrapped model chunk, or the list of them (virtual pipeline stages).
        optimizer: the Megatron optimizer (chained or not; mcore_compat's on 0.4/0.5) or ``None`` (weights only).
        scheduler: an object with ``state_dict()``/``load_state_dict()`` (Megatron's OptimizerParamScheduler).
        extra: a dict of tensors and plain Python values (str, int, float, bool, None, lists and dicts of them),
            each rank's own.
        iteration: the training iteration, returned by :func:`~.load.load_checkpoint`.
        unsafe_skip_fsync: skip every fsync (faster on a slow filesystem); UNSAFE: after a machine crash the
            checkpoint, and the previous one it replaced, may be lost or incomplete.

    Returns:
        The checkpoint directory.

    Raises:
        CheckpointError: on every rank, one line naming the first failing rank and the cause: ``extra`` holds
            something the weights-only loader cannot read, the optimizer's state cannot be read (a
            precision-aware optimizer), ``path`` is a file or holds other files, permission denied, no space
            left (with the bytes needed and free), any other write error. The previous checkpoint at ``path`` is
            unchanged and the partial files are removed.
    """
    started = _Save.begin(path, chunks, optimizer, scheduler, extra, iteration, unsafe_skip_fsync)
    started.write()
    return started.conclude()


def save_checkpoint_async(path: str | os.PathLike[str], chunks: Any, optimizer: Any = None, *,
                          scheduler: Any = None, extra: dict[str, Any] | None = None, iteration: int | None = None,
                          unsafe_skip_fsync: bool = False) -> SaveHandle:
    """:func:`save_checkpoint` in the background: returns once this rank's state is copied to host memory (the
    model, optimizer, scheduler, RNG states and ``extra``, so training may go on and change them), and a thread
    of this rank writes, checksums and fsyncs its shard meanwhile. :meth:`SaveHandle.wait` - on every rank,
    collective - then publishes the checkpoint (or raises the failure on every rank); a later save, sync or
    background, waits for it first. Until it is published the previous checkpoint at ``path`` stays as it was,
    also if the process dies meanwhile.

    Args and Raises: as :func:`save_checkpoint` (a failure before the shard is written - the path, the state that
    cannot be read - is raised here on every rank, one while writing by :meth:`SaveHandle.wait`).
    """
    started = _Save.begin(path, chunks, optimizer, scheduler, extra, iteration, unsafe_skip_fsync)
    try:  # a rank whose state could not be copied: every rank hears it now, not at wait()
        failed = started.entry if started.payload is None and isinstance(started.entry, str) else None
        _agree(f"saving {started.root}", failed, kept=True)
    except CheckpointError:
        if started.where.rank == 0:
            shutil.rmtree(started.stage, ignore_errors=True)
        raise
    handle = SaveHandle(started)
    _PENDING.append(handle)
    return handle


class SaveHandle:
    """A background save of this rank (:func:`save_checkpoint_async`)."""

    def __init__(self, save: _Save) -> None:
        self.path = save.root
        self._save = save
        self._result: Path | None = None
        self._error: str | None = None
        #: collective work after the checkpoint is published (a run directory's tracker: runs.save_to_run_async)
        self._then: Callable[[Path], None] | None = None
        self._thread = threading.Thread(target=save.write, name="mcore_compat-checkpoint-writer", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        """Whether this rank's shard is written (the checkpoint is published by :meth:`wait`)."""
        return not self._thread.is_alive()

    def wait(self) -> Path:
        """Wait for this rank's shard, then publish the checkpoint (collective: call it on every rank). Returns the
        checkpoint directory; raises the save's :class:`~.errors.CheckpointError` on every rank (again on a second
        call)."""
        if self._result is None and self._error is None:
            self._thread.join()
            with contextlib.suppress(ValueError):
                _PENDING.remove(self)
            try:
                result = self._save.conclude()
                if self._then is not None:
                    self._then(result)
                self._result = result
            except CheckpointError as exc:
                self._error = str(exc)
                raise
        if self._error is not None:
            raise CheckpointError(self._error)
        assert self._result is not None
        return self._result


#: This process's background saves not yet published (at most one: a new save waits for it).
_PENDING: list[SaveHandle] = []


def wait_for_pending() -> None:
    """Publish a background save still running (collective); a save or load calls it first."""
    while _PENDING:
        _PENDING[0].wait()


class _Save:
    """One save on this rank, in three parts: :meth:`begin` (collective: the staging directory, this rank's state
    copied to host memory), :meth:`write` (local: this rank's shard written, checksummed, fsynced, renamed) and
    :meth:`conclude` (collective: rank 0 writes the records and the manifest and publishes; every failure agreed)."""

    def __init__(self, root: Path, stage: Path, where: Coords, payload: Any, records: dict[str, Any],
                 meta: dict[str, Any], durable: bool) -> None:
        self.root, self.stage, self.where, self.payload = root, stage, where, payload
        self.records, self.meta, self.durable = records, meta, durable
        self.entry: dict[str, Any] | str = f"rank {where.rank}: the shard was never written"

    @classmethod
    def begin(cls, path: str | os.PathLike[str], chunks: Any, optimizer: Any, scheduler: Any,
              extra: dict[str, Any] | None, iteration: int | None, unsafe_skip_fsync: bool) -> _Save:
        wait_for_pending()
        chunk_list = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
        durable = not unsafe_skip_fsync
        root = Path(path)
        where = coords(len(chunk_list))
        stage: Path | None = None
        status: str | None = None
        try:
            if extra is not None:
                check_plain(extra)
            if where.rank == 0:
                stage = _start(root, durable)
        except Exception as exc:  # every rank must learn of it, or the others would wait forever
            status = f"rank {where.rank}: {describe(exc, root)}"
        try:
            _agree(f"saving {root}", status, kept=True)
        except CheckpointError:
            if stage is not None:
                shutil.rmtree(stage, ignore_errors=True)
            raise
        stage = stage_name(root)
        payload: Any = None
        status = None
        try:
            payload = _payload(chunk_list, optimizer, scheduler, host_copy(extra), iteration, where)
            first = where.tp == where.dp == where.ep == 0  # one rank per pipeline stage sends its record
            records = {"splits": split_record(chunk_list) if first else {},
                       "stage": stage_record(chunk_list) if first else None}
        except Exception as exc:
            status = f"rank {where.rank}: {describe(exc, stage)}"
            records = {}
        meta = {"distributed_optimizer": _distributed_optimizer(chunk_list), "has_optimizer": optimizer is not None,
                "has_scheduler": scheduler is not None, "iteration": iteration}
        save = cls(root, stage, where, payload, records, meta, durable)
        if status is not None:
            save.entry = status
        return save

    def write(self) -> None:
        """This rank's shard (local; run in the writer thread of a background save)."""
        if self.payload is None:  # begin failed here: conclude agrees on it
            return
        where, stage = self.where, self.stage
        tmp = stage / (shard_name(where.rank) + ".tmp")
        needed: int | None = None
        try:
            file = stage / shard_name(where.rank)
            payload, self.payload = self.payload, None
            needed = _needed(payload)
            sums = tensor_checksums(payload)
            try:
                with _without_crc32(), HashingWriter(tmp) as out:  # the file's checksum as it is written
                    torch.save(payload, out)  # type: ignore[arg-type]  # a file-like with write/flush
                    out.flush()
                    if self.durable:
                        os.fsync(out.fileno())
                    checksum = out.hexdigest()
            except RuntimeError as exc:  # torch reports a full disk as "unexpected pos" from its zip writer
                if shutil.disk_usage(stage).free < needed:
                    raise OSError(errno.ENOSPC, "No space left on device", str(tmp)) from exc
                raise
            del payload
            os.replace(tmp, file)
            self.entry = {"name": file.name, "bytes": file.stat().st_size, "coords": where.as_dict(),
                          **self.records, "checksum": {"file": checksum, "tensors": sums}}
        except Exception as exc:
            self.entry = f"rank {where.rank}: {describe(exc, stage, needed)}"
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)

    def conclude(self) -> Path:
        """Every rank's shard known to rank 0, which writes the records and the manifest and publishes (collective);
        a failure anywhere is raised on every rank and the staging directory removed."""
        try:
            entries = _gather(self.entry)
        except CheckpointError as exc:  # a peer died: nothing is published, the staging directory goes
            if self.where.rank == 0:
                shutil.rmtree(self.stage, ignore_errors=True)
            raise _peer_lost(f"saving {self.root}", exc, kept=True) from exc
        failed = [e for e in entries if isinstance(e, str)]
        status = None
        published = False
        if not failed and self.where.rank == 0:
            try:
                _finish(self.root, self.stage, entries, self.where, self.meta, self.durable)
                published = True
            except Exception as exc:
                status = f"rank 0: {describe(exc, self.stage)}"
        elif failed:
            status = failed[0]
        if status is not None and self.where.rank == 0:
            shutil.rmtree(self.stage, ignore_errors=True)
        try:
            _agree(f"saving {self.root}", status, kept=not published)
        except CheckpointError as exc:
            if published:  # a peer died after the last exchange: the checkpoint is complete all the same
                raise CheckpointError(f"{self.root} is complete and published, but then {exc}") from exc
            raise
        return self.root


def _finish(root: Path, stage: Path, entries: list[Any], where: Coords, meta: dict[str, Any],
            durable: bool) -> None:
    """Rank 0: the records, checksums and manifest into ``stage``, the marker removed, then published."""
    shards = [e for e in entries if isinstance(e, dict)]
    sums = {"algorithm": ALGORITHM, "shards": {e["name"]: e.pop("checksum") for e in shards}}
    write_json(stage / TP_RECORD, _tensor_parallel(shards), durable)
    write_json(stage / PP_RECORD, _pipeline(shards), durable)
    write_json(stage / CHECKSUMS, sums, durable)
    write_json(stage / MANIFEST, manifest_dict(
        format=FORMAT, format_version=FORMAT_VERSION, mcore_compat=__version__, megatron_core=_version(),
        torch=torch.__version__, layout=where.layout(), files=[ShardFile(**e) for e in shards], **meta), durable)
    (stage / MARKER).unlink()
    if durable:
        fsync_dir(stage)
    publish(stage, root, durable)
