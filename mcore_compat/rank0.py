"""Rank-zero logging that works before and after ``torch.distributed`` is initialised.

Before ``init_process_group`` the rank is read from the launcher's environment (``RANK``, as set by
``torchrun``/``torch.multiprocessing`` launchers, then ``SLURM_PROCID``, then ``OMPI_COMM_WORLD_RANK``), so a
script launched on 8 ranks prints once even before the process group exists.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

__all__ = ["get_rank", "is_rank_0", "log_rank_0", "print_rank_0", "reset_warn_once", "warn_once_rank_0"]

_LOGGER = logging.getLogger("mcore_compat")
_RANK_ENV = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_WARNED: set[tuple[str, type[Warning]]] = set()


def get_rank() -> int:
    """The global rank: from ``torch.distributed`` once initialised, else from the launcher's environment."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        try:
            if dist.is_available() and dist.is_initialized():
                return int(dist.get_rank())
        except Exception:  # a half-torn-down group: fall back to the environment
            pass
    for key in _RANK_ENV:
        value = os.environ.get(key)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return 0


def is_rank_0() -> bool:
    """Whether this process is global rank 0 (``True`` in a single, unlaunched process)."""
    return get_rank() == 0


def print_rank_0(*args: Any, **kwargs: Any) -> None:
    """``print(*args, **kwargs)`` on global rank 0 only (flushes by default)."""
    if is_rank_0():
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def log_rank_0(message: str, *args: Any, level: int = logging.INFO, logger: logging.Logger | None = None) -> None:
    """Log ``message % args`` at ``level`` on global rank 0 only (default logger: ``"mcore_compat"``)."""
    if is_rank_0():
        (logger or _LOGGER).log(level, message, *args)


def warn_once_rank_0(message: str, category: type[Warning] = UserWarning, stacklevel: int = 2) -> bool:
    """Emit ``warnings.warn(message, category)`` once per process, on global rank 0 only.

    Returns:
        ``True`` if the warning was emitted by this call.
    """
    key = (message, category)
    if key in _WARNED:
        return False
    _WARNED.add(key)
    if not is_rank_0():
        return False
    # ``stacklevel`` counts from the caller; called from a script's top level there is no frame that far up, and
    # Python would blame ``sys:1``: point at the outermost frame there is instead
    depth = 0
    frame: Any = sys._getframe(0)
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    warnings.warn(message, category, stacklevel=max(1, min(stacklevel + 1, depth)))
    return True


def reset_warn_once() -> None:
    """Forget which warnings :func:`warn_once_rank_0` has emitted (for tests)."""
    _WARNED.clear()
