"""A command-line entry point that survives a closed pipe (``mcore-compat doctor | head``).

Python ignores SIGPIPE, so a write to a pipe whose reader has gone raises :class:`BrokenPipeError` (and once more
when the interpreter flushes ``sys.stdout`` at exit). :func:`exit_status` runs the command, flushes its output
while it can still report, and on a closed pipe points ``stdout`` at ``os.devnull`` and returns
:data:`EXIT_CLOSED_PIPE`, the status a shell reports for a writer stopped by SIGPIPE; nothing is printed. This
module imports nothing of mcore_compat (``python -m mcore_compat.support`` uses it too).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

__all__ = ["EXIT_CLOSED_PIPE", "exit_status"]

#: 128 + SIGPIPE: what ``cmd | head`` reports for ``cmd`` under ``set -o pipefail``, as for coreutils.
EXIT_CLOSED_PIPE = 141


def exit_status(command: Callable[[], int]) -> int:
    """``command()``'s exit status, or :data:`EXIT_CLOSED_PIPE` (silently) if its reader closed ``stdout``."""
    try:
        try:
            status = command()
        except SystemExit:  # argparse's --help and errors: their text is still in the buffer
            sys.stdout.flush()
            raise
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())  # the flush at exit now goes nowhere instead of raising again
        finally:
            os.close(devnull)
        return EXIT_CLOSED_PIPE
