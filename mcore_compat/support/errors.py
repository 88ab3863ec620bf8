"""The errors of the support matrix, on :mod:`mcore_compat.errors`' classes.

``noxfile.py`` loads this package from its source files as a top-level package of another name, where
``mcore_compat`` cannot be imported (relative imports stop at the package): then ``mcore_compat/errors.py``, which
imports nothing, is loaded from its file instead, so the classes are the same in both settings.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

__all__ = ["InvalidArgumentError", "MatrixFileError", "MatrixNotFoundError", "McoreCompatError", "NotFoundError"]


def _errors_from_source() -> Any:
    """``mcore_compat/errors.py`` of the source tree this package lies in, loaded from its file."""
    name = f"{__package__}._mcore_compat_errors"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "errors.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


try:
    from .. import errors as _errors
except ImportError:  # loaded on its own (noxfile.py): no mcore_compat package above this one
    _errors = _errors_from_source()

McoreCompatError = _errors.McoreCompatError
InvalidArgumentError = _errors.InvalidArgumentError
NotFoundError = _errors.NotFoundError


class MatrixFileError(McoreCompatError, ValueError):
    """``matrix/versions.toml`` is malformed; the message names the release and the entry to fix. Also a
    :class:`ValueError`."""


class MatrixNotFoundError(McoreCompatError, FileNotFoundError):
    """The support matrix's files are not where they are looked for. Also a :class:`FileNotFoundError`."""
