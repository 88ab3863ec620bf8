"""What Megatron and torch print on the self-check's ranks: Python warnings and WARNING log records, recorded on each
rank instead of printed there, then merged over ranks so that the report shows each distinct one once.

Without this every rank prints the same import-time warnings (about 28 lines on 0.8.0 at 2 ranks) above the report.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

__all__ = ["capture", "drain", "merge", "release"]

#: (category, message, where) of everything recorded in this process since the last :func:`drain`.
_RECORDED: list[tuple[str, str, str]] = []
#: While capturing: the replaced ``warnings.showwarning`` and the handler added to the root logger.
_INSTALLED: list[tuple[Any, logging.Handler]] = []


class _Recorder(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # a malformed record must not break the run
            text = str(record.msg)
        _RECORDED.append((f"log {record.levelname}", text, f"{record.name} ({record.pathname}:{record.lineno})"))


def _show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
          line: str | None = None) -> None:
    _RECORDED.append((category.__name__, str(message).strip(), f"{filename}:{lineno}"))


def capture() -> None:
    """Record this process's warnings and WARNING (or worse) log records instead of printing them (idempotent).

    Only for a process that mcore-compat started for the self-check: the root logger gets a handler (so Python's
    last-resort handler stops printing) and ``warnings.showwarning`` is replaced.
    """
    if _INSTALLED:
        return
    handler = _Recorder(level=logging.WARNING)
    _INSTALLED.append((warnings.showwarning, handler))
    warnings.showwarning = _show
    logging.getLogger().addHandler(handler)


def release() -> None:
    """Undo :func:`capture` (the self-check under ``torchrun`` runs in the caller's own process)."""
    if _INSTALLED:
        show, handler = _INSTALLED.pop()
        warnings.showwarning = show
        logging.getLogger().removeHandler(handler)


def drain() -> list[tuple[str, str, str]]:
    """Everything recorded since the last call (and forget it)."""
    out = list(_RECORDED)
    _RECORDED.clear()
    return out


def merge(per_rank: Sequence[Sequence[Sequence[str]]]) -> list[dict[str, Any]]:
    """The distinct warnings of all ranks, in first-seen order.

    Args:
        per_rank: each rank's :func:`drain` (index = rank).

    Returns:
        ``[{"category", "message", "where", "count", "ranks"}]``: ``count`` is how often it was recorded in all,
        ``ranks`` the ranks that recorded it.
    """
    merged: dict[tuple[str, str, str], dict[str, Any]] = {}
    for rank, recorded in enumerate(per_rank):
        for category, message, where in recorded:
            entry = merged.setdefault((category, message, where), {
                "category": category, "message": message, "where": where, "count": 0, "ranks": []})
            entry["count"] += 1
            if rank not in entry["ranks"]:
                entry["ranks"].append(rank)
    return list(merged.values())
