"""The file operations of a checkpoint save: durable writes, checksums, the staging directory and its publication.

* :func:`file_checksum`, :func:`tensor_checksums`, :func:`verify_shard`: the shard's checksum (:data:`ALGORITHM`,
  xxHash's XXH3 64-bit, ``xxhash`` on PyPI: BSD-licensed, wheels for every platform, hashes at memory speed) and
  each host tensor's, and the check of a shard against them (naming the first tensor that differs).
* :func:`fsync_file`, :func:`fsync_dir`: what makes a checkpoint durable (``durable=False`` skips them).
* :func:`publish`: the staging directory replaces the checkpoint directory with one rename: on Linux
  ``renameat2(RENAME_EXCHANGE)`` swaps the two directories atomically (glibc 2.28+; the old one is then removed);
  elsewhere, or where the filesystem refuses the exchange, the old directory is first renamed to
  :func:`old_name`, then the new one to the checkpoint's name (a crash between the two leaves both beside it,
  named, and :func:`~.manifest.read_manifest` says where they are).
* :func:`describe`: one line for an ``OSError`` of a save (disk full with the bytes needed and free, permission
  denied, a path that is a file, a read-only filesystem).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
from pathlib import Path
from typing import Any

import torch

__all__ = ["ALGORITHM", "describe", "file_checksum", "fsync_dir", "fsync_file", "old_name", "publish",
           "stage_name", "tensor_checksums", "verify_shard"]

#: The checksum of every shard and tensor: XXH3, 64 bits, as 16 hex digits.
ALGORITHM = "xxh3_64"
_READ = 1 << 23  # bytes per read when a file is hashed


def _hasher() -> Any:
    import xxhash

    return xxhash.xxh3_64()


def stage_name(root: Path) -> Path:
    """Where a save to ``root`` is written before it is published (a hidden sibling)."""
    return root.with_name(f".{root.name}.mcore_compat_saving")


def old_name(root: Path) -> Path:
    """Where the checkpoint that a save replaces sits while the new one is published (a hidden sibling)."""
    return root.with_name(f".{root.name}.mcore_compat_old")


def file_checksum(path: Path) -> str:
    """The checksum (:data:`ALGORITHM`) of the file at ``path``, read in chunks."""
    h = _hasher()
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(_READ)
        view = memoryview(buf)
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return str(h.hexdigest())


class HashingWriter:
    """A binary file open for writing that checksums (:data:`ALGORITHM`) what is written through it, as it is
    written (``torch.save`` writes a shard sequentially through ``write``): the shard's checksum without reading
    the file back. ``hexdigest()`` equals :func:`file_checksum` of the file once closed."""

    def __init__(self, path: Path) -> None:
        self.name = str(path)  # as a file object names its file (no __fspath__: torch.save would open the path)
        self._fh = open(path, "wb")  # closed by close() / the context manager
        self._h = _hasher()

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._h.update(view)
        return self._fh.write(view)

    def flush(self) -> None:
        self._fh.flush()

    def fileno(self) -> int:
        return self._fh.fileno()

    def close(self) -> None:
        self._fh.close()

    def hexdigest(self) -> str:
        return str(self._h.hexdigest())

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.close()


def _tensor_checksum(t: torch.Tensor) -> str:
    h = _hasher()
    data = t.detach().contiguous().reshape(-1)
    if data.numel():
        h.update(memoryview(data.view(torch.uint8).numpy()))  # type: ignore[arg-type]  # numpy's buffer
    return str(h.hexdigest())


def tensor_checksums(value: Any, prefix: str = "") -> dict[str, str]:
    """The checksum of every host-memory tensor in ``value`` (nested dicts, lists, tuples), keyed by its path
    (``model[0].fc2.weight``); tensors on a device are left out (hashing them would need another host copy)."""
    out: dict[str, str] = {}
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu":
            out[prefix] = _tensor_checksum(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            out.update(tensor_checksums(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            out.update(tensor_checksums(v, f"{prefix}[{i}]"))
    return out


def verify_shard(path: Path, recorded: dict[str, Any], label: str) -> str | None:
    """``None`` when the file at ``path`` has the checksum ``recorded`` (its :data:`CHECKSUMS` entry); else one
    line naming the shard (``label``) and, where the file still loads, the first tensor whose checksum differs."""
    found = file_checksum(path)
    if found == recorded.get("file"):
        return None
    where = ""
    tensors = recorded.get("tensors") or {}
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # too damaged to load: the shard is named alone
        data = None
    if data is not None and tensors:
        now = tensor_checksums(data)
        bad = [k for k, v in tensors.items() if now.get(k) != v]
        if bad:
            where = (f"; tensor {bad[0]} differs" if len(bad) == 1 else
                     f"; tensors {bad[0]} and {len(bad) - 1} more differ")
    return (f"shard {label} fails its checksum ({ALGORITHM} {found}, the checkpoint recorded {recorded.get('file')})"
            f"{where}: corrupted on disk or in a copy; restore the file from a good copy or load an earlier "
            "checkpoint")


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make ``path``'s entries (files created, renamed or removed in it) durable; a no-op where directories
    cannot be opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems refuse fsync on a directory
        if exc.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the directories ``a`` and ``b`` atomically (Linux ``renameat2``); ``False`` where that is not there."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish(stage: Path, root: Path, durable: bool) -> None:
    """Put the complete checkpoint in ``stage`` at ``root``; the checkpoint that was there is removed only after
    the new one is in place (and, when ``durable``, the rename is on disk)."""
    parent = root.parent
    if not root.exists():
        os.rename(stage, root)
        old = None
    elif _exchange(stage, root):
        old = stage
    else:
        old = old_name(root)
        shutil.rmtree(old, ignore_errors=True)
        os.rename(root, old)
        os.rename(stage, root)
    if durable:
        fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _size(n: int) -> str:
    return f"{n} bytes ({n / 2**30:.2f} GiB)" if n >= 2**30 else f"{n} bytes"


def describe(exc: BaseException, where: Path, needed: int | None = None) -> str:
    """One line for an error of a save at ``where`` (``needed``: the bytes this rank was writing)."""
    if isinstance(exc, OSError):
        name = exc.filename or where
        if exc.errno == errno.ENOSPC:
            try:
                free = shutil.disk_usage(where if where.exists() else where.parent).free
            except OSError:
                free = -1
            need = f"needs about {_size(needed)}, " if needed else ""
            return (f"no space left on device writing {name}: {need}"
                    f"{'free ' + _size(free) if free >= 0 else 'free space unknown'}; free space or save elsewhere")
        if exc.errno in (errno.EACCES, errno.EPERM):
            return f"permission denied: {name}: make it writable for this user or save elsewhere"
        if exc.errno == errno.EROFS:
            return f"read-only filesystem: {name}: save elsewhere"
        if exc.errno in (errno.ENOTDIR, errno.EEXIST):
            return f"{name} (or a directory above it) is a file, not a directory: choose another path"
        if exc.errno == errno.EDQUOT:
            return f"disk quota exceeded writing {name}: free space or save elsewhere"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"
