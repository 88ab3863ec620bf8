"""Where a job's output goes (the console or a log file) and how its commands run."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO

_PRINT_LOCK = threading.Lock()


class JobError(RuntimeError):
    """A preparation step or check failed (the message says which and why)."""


def console(text: str) -> None:
    """Print one line to the console, whole (jobs on several threads print)."""
    with _PRINT_LOCK:
        print(text, flush=True)


class Out:
    """One job's output: the console (``log=None``) or a log file that is truncated on open.

    Args:
        log: the log file, or ``None`` for the console.
    """

    def __init__(self, log: Path | None = None) -> None:
        self.log = log
        self._fh: IO[str] | None = None
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            self._fh = log.open("w", encoding="utf-8")

    def say(self, text: str) -> None:
        """Write one line to the job's output."""
        if self._fh is not None:
            self._fh.write(text + "\n")
            self._fh.flush()
        else:
            console(text)

    def run(self, argv: Sequence[str | Path], env: dict[str, str] | None = None, check: bool = True,
            cwd: Path | None = None) -> int:
        """Run a command, its output going to the job's output.

        Args:
            argv: the command; a multi-line argument is echoed as ``<script>``.
            env: its environment (``None``: this process's).
            check: raise if it fails.
            cwd: its working directory (``None``: this process's).

        Returns:
            The exit status.

        Raises:
            JobError: ``check`` is set and the command failed.
        """
        args = [str(a) for a in argv]
        self.say("$ " + " ".join("<script>" if "\n" in a else a for a in args))
        proc = subprocess.run(args, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=self._fh,
                              stderr=subprocess.STDOUT if self._fh is not None else None, check=False)
        if check and proc.returncode != 0:
            raise JobError(f"command failed with exit status {proc.returncode}: {' '.join(args)}")
        return proc.returncode

    def close(self) -> None:
        """Close the log file (a console output has nothing to close)."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
