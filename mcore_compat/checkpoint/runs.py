"""Run directories: the checkpoints of one training run side by side, found by iteration, in Megatron-LM's layout.

::

    run/iter_0000100/                      a checkpoint (save_checkpoint's format, or Megatron-LM's own)
    run/iter_0000200/
    run/latest_checkpointed_iteration.txt  "200": written last, atomically (the tracker)

The names are Megatron-LM's (``megatron/training/checkpointing.py``: ``get_checkpoint_name`` writes
``iter_{:07d}``, ``get_checkpoint_tracker_filename`` the tracker ``latest_checkpointed_iteration.txt`` holding the
iteration), so a run directory of either is read by the other's tools. :func:`save_to_run` saves
``iter_<iteration>`` (atomic and durable, :func:`~.save.save_checkpoint`), then rewrites the tracker, then removes
the oldest complete checkpoints beyond ``keep_last`` and the staging directories of killed saves: a save that fails or is killed leaves every earlier
checkpoint and the tracker as they were. :func:`latest_checkpoint` finds the newest complete checkpoint, whatever the
tracker says (a checkpoint newer than the tracker is complete once published; an incomplete or damaged one is
skipped with one line naming why); :func:`~.load.load_checkpoint` of a run directory loads it.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import CheckpointError, CheckpointFormatError
from .files import fsync_dir, fsync_file
from .manifest import MANIFEST, MARKER, marker_state, read_manifest
from .megatron_files import is_megatron_checkpoint

if TYPE_CHECKING:
    from .save import SaveHandle

__all__ = ["ITERATION_DIR", "TRACKER", "RunCheckpoint", "is_run_directory", "latest_checkpoint", "run_checkpoints",
           "save_to_run", "save_to_run_async", "tracked_iteration"]

#: A checkpoint's directory in a run directory (Megatron-LM's ``get_checkpoint_name``).
ITERATION_DIR = "iter_{:07d}"
#: The tracker file: the newest saved iteration, as text (Megatron-LM's ``get_checkpoint_tracker_filename``).
TRACKER = "latest_checkpointed_iteration.txt"
_ITERATION = re.compile(r"iter_(\d{7,})")
#: :func:`.files.stage_name` of an ``iter_*`` directory
_STAGE = re.compile(r"\.iter_\d{7,}\.mcore_compat_saving")


@dataclass(frozen=True)
class RunCheckpoint:
    """One ``iter_*`` directory of a run directory.

    Attributes:
        iteration: the iteration in its name.
        path: the directory.
        problem: why it cannot be loaded (one line), or ``None`` for a complete checkpoint.
        writer: ``"mcore_compat"`` or ``"megatron"`` (a ``dist_checkpointing`` directory Megatron-LM wrote).
    """

    iteration: int
    path: Path
    problem: str | None
    writer: str = "mcore_compat"

    @property
    def complete(self) -> bool:
        return self.problem is None


def is_run_directory(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a run directory: no checkpoint of its own (no manifest, no Megatron metadata), and a
    tracker or at least one ``iter_*`` directory."""
    root = Path(path)
    if not root.is_dir() or (root / MANIFEST).exists() or is_megatron_checkpoint(root):
        return False
    return (root / TRACKER).is_file() or any(_ITERATION.fullmatch(p.name) and p.is_dir() for p in root.iterdir())


def _examine(path: Path, iteration: int) -> RunCheckpoint:
    if is_megatron_checkpoint(path):
        return RunCheckpoint(iteration, path, None, "megatron")
    try:
        read_manifest(path)
    except CheckpointError as exc:
        return RunCheckpoint(iteration, path, str(exc))
    return RunCheckpoint(iteration, path, None)


def run_checkpoints(run_dir: str | os.PathLike[str]) -> list[RunCheckpoint]:
    """The ``iter_*`` directories of ``run_dir``, oldest first, each with why it cannot be loaded (``problem``:
    no manifest, a shard missing or short, a save in progress or interrupted), without reading the shards."""
    root = Path(run_dir)
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _ITERATION.fullmatch(p.name)) and p.is_dir()]
    return [_examine(p, n) for n, p in sorted(found)]


def tracked_iteration(run_dir: str | os.PathLike[str]) -> int | None:
    """The iteration the tracker names (``None``: no tracker, or ``release`` or unreadable text)."""
    try:
        text = (Path(run_dir) / TRACKER).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path:
    """The newest complete checkpoint of ``run_dir``; every newer ``iter_*`` directory that cannot be loaded is
    skipped with a one-line warning naming why.

    Raises:
        CheckpointFormatError: ``run_dir`` holds no complete checkpoint (each ``iter_*`` directory named with its
            problem).
    """
    entries = run_checkpoints(run_dir)
    for entry in reversed(entries):
        if entry.complete:
            return entry.path
        warnings.warn(f"mcore-compat: skipping {entry.path.name} of {run_dir}: {entry.problem}", RuntimeWarning,
                      stacklevel=2)
    if not entries:
        raise CheckpointFormatError(f"{run_dir} holds no checkpoint (no iter_* directory)")
    raise CheckpointFormatError(f"{run_dir} holds no complete checkpoint: " + "; ".join(
        f"{e.path.name}: {e.problem}" for e in entries))


def _write_tracker(root: Path, iteration: int, durable: bool) -> None:
    """The tracker rewritten atomically: a temporary file, fsynced, renamed over the old one, the directory
    fsynced."""
    tmp = root / f".{TRACKER}.tmp"
    try:
        tmp.write_text(f"{iteration}\n", encoding="utf-8")
        if durable:
            fsync_file(tmp)
        os.replace(tmp, root / TRACKER)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(root)


def _retire(root: Path, keep_last: int, newest: Path, durable: bool) -> list[Path]:
    """Remove the oldest complete mcore_compat checkpoints beyond ``keep_last`` (never ``newest``; incomplete and
    Megatron-written directories are left alone); returns what was removed."""
    complete = [e for e in run_checkpoints(root) if e.complete and e.writer == "mcore_compat"]
    removed = []
    for entry in complete[:max(len(complete) - keep_last, 0)]:
        if entry.path == newest:
            continue
        shutil.rmtree(entry.path)
        removed.append(entry.path)
    if removed and durable:
        fsync_dir(root)
    return removed


def _sweep_stale_stages(root: Path) -> list[Path]:
    """Remove the staging directories of killed saves to other iterations (their writer gone, or no marker at all);
    returns what was removed. A staging directory never holds the only copy of a checkpoint."""
    removed = []
    for p in root.iterdir():
        if _STAGE.fullmatch(p.name) and p.is_dir():
            marker = p / MARKER
            if not marker.exists() or marker_state(marker)[0] == "gone":
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def _arguments(iteration: Any, keep_last: Any, what: str) -> None:
    if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
        raise CheckpointError(f"{what}: iteration must be an int >= 0, got {iteration!r}")
    if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
        raise CheckpointError(f"{what}: keep_last must be an int >= 1 or None, got {keep_last!r}")


def _update_run(root: Path, iteration: int, path: Path, keep_last: int | None, durable: bool) -> None:
    """Rank 0: the tracker, the retirement and the sweep of killed saves' staging directories, once ``path`` is
    complete; the outcome agreed by every rank (collective)."""
    from .save import _agree, _rank

    status = None
    if _rank() == 0:
        try:
            _write_tracker(root, iteration, durable)
            if keep_last is not None:
                _retire(root, keep_last, path, durable)
            _sweep_stale_stages(root)
        except OSError as exc:
            status = f"rank 0: {path} is complete, but {exc.strerror or exc} ({exc.filename or root})"
    _agree("updating the run directory's tracker and retiring old checkpoints", status)


def save_to_run(run_dir: str | os.PathLike[str], iteration: int, chunks: Any, optimizer: Any = None, *,
                scheduler: Any = None, extra: dict[str, Any] | None = None, keep_last: int | None = None,
                unsafe_skip_fsync: bool = False) -> Path:
    """Save ``iter_<iteration>`` in the run directory ``run_dir``, then the tracker, then retire old checkpoints.
    Call it on every rank, between steps.

    The checkpoint is saved by :func:`~.save.save_checkpoint` (atomic and durable; the same arguments); only when
    it is complete does rank 0 rewrite the tracker (atomically) and remove the oldest complete checkpoints beyond
    ``keep_last`` and the staging directories that killed saves left (their writer gone). A save that fails or is killed leaves the earlier checkpoints and the tracker as they were.

    Args:
        run_dir: the run directory (created if missing).
        iteration: the training iteration (>= 0): the directory's name and the checkpoint's ``iteration``.
        keep_last: keep this many complete checkpoints (>= 1), the new one included; ``None`` keeps all.

    Returns:
        The new checkpoint's directory.

    Raises:
        CheckpointError: on every rank, one line: see :func:`~.save.save_checkpoint`; also a bad ``iteration``
            or ``keep_last``, or the tracker or the retirement failing (then the new checkpoint is complete and
            loadable).
    """
    from .save import save_checkpoint

    _arguments(iteration, keep_last, "save_to_run")
    root = Path(run_dir)
    path = save_checkpoint(root / ITERATION_DIR.format(iteration), chunks, optimizer, scheduler=scheduler,
                           extra=extra, iteration=iteration, unsafe_skip_fsync=unsafe_skip_fsync)
    _update_run(root, iteration, path, keep_last, not unsafe_skip_fsync)
    return path


def save_to_run_async(run_dir: str | os.PathLike[str], iteration: int, chunks: Any, optimizer: Any = None, *,
                      scheduler: Any = None, extra: dict[str, Any] | None = None, keep_last: int | None = None,
                      unsafe_skip_fsync: bool = False) -> SaveHandle:
    """:func:`save_to_run` in the background: returns once this rank's state is copied to host memory
    (:func:`~.save.save_checkpoint_async`); :meth:`~.save.SaveHandle.wait` (every rank, collective) publishes
    ``iter_<iteration>``, then rank 0 rewrites the tracker and retires old checkpoints. Until then the tracker
    and the earlier checkpoints stay as they were, also if the process dies meanwhile; a later save or load
    waits for it first.

    Args and Raises: as :func:`save_to_run` (a bad ``iteration`` or ``keep_last`` is raised here; a failure
    while writing, publishing or updating the tracker by :meth:`~.save.SaveHandle.wait`, on every rank).
    """
    from .save import save_checkpoint_async

    _arguments(iteration, keep_last, "save_to_run_async")
    root = Path(run_dir)
    handle = save_checkpoint_async(root / ITERATION_DIR.format(iteration), chunks, optimizer, scheduler=scheduler,
                                   extra=extra, iteration=iteration, unsafe_skip_fsync=unsafe_skip_fsync)
    handle._then = lambda path: _update_run(root, iteration, path, keep_last, not unsafe_skip_fsync)
    return handle
