"""The ``mcore-compat`` command: ``doctor`` and ``self-check``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from .._version import __version__

__all__ = ["build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: what is wrong and where the usage is (argparse prints the
    whole usage first, which buries the message under the self-check's ~20 options)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``mcore-compat`` (subcommands register themselves here)."""
    return _build()[0]


def _build() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser and its subcommands' parsers by name."""
    from . import checkpoint, doctor, scan, selfcheck

    parser = _Parser(
        prog="mcore-compat",
        description="One API over every Megatron-Core release: inspect the install (doctor) and prove that "
        "training through mcore_compat updates weights correctly (self-check).",
    )
    parser.add_argument("--version", action="version", version=f"mcore-compat {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    doctor.add_parser(sub)
    selfcheck.add_parser(sub)
    checkpoint.add_parser(sub)
    scan.add_parser(sub)
    return parser, dict(sub.choices)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status (2 for bad arguments, with the usage of the subcommand they
    were given to; 141 with nothing printed when the reader of a pipe closed it, ``... | head``)."""
    from .._util.pipes import exit_status

    code = exit_status(lambda: _main(argv))
    if argv is None:  # the program itself (``mcore-compat``, ``python -m mcore_compat``), not a call from code
        _end_torchrun_job(code)
    return code


def _end_torchrun_job(code: int) -> None:
    """Under torchrun, a command that joined the process group (``self-check``) ends its rank the way a job should
    (:func:`mcore_compat.launch.end_job`); elsewhere nothing happens."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        from ..launch import end_job

        end_job(code)


def _main(argv: Sequence[str] | None) -> int:
    parser, commands = _build()
    args, unknown = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if unknown:  # argparse would blame the top-level parser and print its usage, not the subcommand's
        commands.get(getattr(args, "command", None) or "", parser).error(
            f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)
