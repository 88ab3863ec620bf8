"""Progress of a long self-check on a terminal: one line per configuration and per verified step.

The ranks run in other processes and their output is captured (the report summarises it), so rank 0 appends its
progress lines to a file whose path the CLI puts in the environment (:data:`ENV`) before it starts them, and the
CLI prints each new line to its terminal as it appears (:class:`Follower`). Nothing is written where the variable
is not set: the CLI sets it only when its standard error is a terminal and ``--json`` is not given, so piped
output and machine-read runs stay as they were.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import TextIO

__all__ = ["ENV", "Follower", "note"]

#: The environment variable naming the progress file (set by the CLI for the ranks it starts).
ENV = "MCORE_COMPAT_PROGRESS"


def note(text: str) -> None:
    """Append one progress line (rank 0 only; nothing where :data:`ENV` is unset)."""
    path = os.environ.get(ENV)
    if not path:
        return
    from ..rank0 import is_rank_0

    if not is_rank_0():
        return
    try:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(text.replace("\n", " ") + "\n")
    except OSError:
        pass  # progress is a courtesy: never a reason to fail the check


class Follower:
    """Within: the lines appended to ``path`` are printed to ``stream`` as they appear (a thread polling every
    ``interval`` seconds), each prefixed with ``prefix``; the rest is printed on exit and the file removed."""

    def __init__(self, path: Path, stream: TextIO, prefix: str = "  ... ", interval: float = 0.2) -> None:
        self.path, self.stream, self.prefix, self.interval = path, stream, prefix, interval
        self._offset = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mcore_compat-progress", daemon=True)

    def __enter__(self) -> Follower:
        self.path.write_text("", encoding="utf-8")
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self._emit()
        try:
            self.path.unlink()
        except OSError:
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._emit()

    def _emit(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as fh:
                fh.seek(self._offset)
                text = fh.read()
        except OSError:
            return
        complete = text[:text.rfind("\n") + 1]  # a line still being written waits for the next poll
        self._offset += len(complete.encode("utf-8"))
        for line in complete.splitlines():
            self.stream.write(f"{self.prefix}{line}\n")
        if complete:
            self.stream.flush()


def elapsed(start: float) -> str:
    """``"12.3 s"`` since ``start`` (a ``time.monotonic()`` value)."""
    return f"{time.monotonic() - start:.1f} s"
