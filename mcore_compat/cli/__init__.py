"""The ``mcore-compat`` command: ``doctor`` and ``self-check``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .._version import __version__

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``mcore-compat`` (subcommands register themselves here)."""
    from . import doctor, selfcheck

    parser = argparse.ArgumentParser(
        prog="mcore-compat",
        description="One API over every Megatron-Core release: inspect the install (doctor) and prove that "
        "training through mcore_compat updates weights correctly (self-check).",
    )
    parser.add_argument("--version", action="version", version=f"mcore-compat {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    doctor.add_parser(sub)
    selfcheck.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)
