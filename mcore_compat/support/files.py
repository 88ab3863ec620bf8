"""Where the support matrix's files are: the installed package data or the source tree's ``matrix/``."""

from __future__ import annotations

import importlib.resources
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import MatrixNotFoundError

if TYPE_CHECKING:  # pragma: no cover
    from importlib.resources.abc import Traversable

__all__ = ["README_FILE", "RESULTS_FILE", "VERSIONS_FILE", "atomic_write", "default_dir", "package_matrix_dir",
           "source_matrix_dir", "writable_dir"]

VERSIONS_FILE = "versions.toml"
RESULTS_FILE = "results.json"
README_FILE = "README.md"


def source_matrix_dir() -> Path | None:
    """``matrix/`` of the source tree this module (or the current directory) belongs to, if any."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        candidate = root / "matrix"
        if (candidate / VERSIONS_FILE).is_file() and (root / "pyproject.toml").is_file():
            return candidate
    return None


def package_matrix_dir() -> Traversable | None:
    """The installed package data ``mcore_compat.matrix`` (``None`` in a plain source checkout)."""
    try:
        data = importlib.resources.files("mcore_compat.matrix")
    except (ModuleNotFoundError, TypeError):
        return None
    return data if data.joinpath(VERSIONS_FILE).is_file() else None


def default_dir() -> Traversable:
    """Where the matrix is read from: the installed package data, else the source tree's ``matrix/``.

    Raises:
        MatrixNotFoundError: neither is available.
    """
    found = package_matrix_dir() or source_matrix_dir()
    if found is None:
        raise MatrixNotFoundError(
            "cannot find the support matrix: neither the package data mcore_compat.matrix nor "
            "a source tree's matrix/versions.toml is available"
        )
    return found


def writable_dir(path: str | os.PathLike[str] | None) -> Path:
    """Where results and the README are written: ``path``, else the source tree's ``matrix/``.

    Raises:
        MatrixNotFoundError: ``path`` is ``None`` and no source tree is found.
    """
    if path is not None:
        return Path(path)
    found = source_matrix_dir()
    if found is None:
        raise MatrixNotFoundError(
            "results are written to the source tree's matrix/ directory, which was not found "
            "(run from the repository root or pass path=...)"
        )
    return found


def atomic_write(target: Path, text: str) -> None:
    """Write ``text`` to ``target`` through a temporary file and a rename (readers never see half a file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

