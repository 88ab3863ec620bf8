"""``mcore-compat scan PATH [--release V ...] [--json] [--fix] [--check]``: a codebase's Megatron-Core imports per
release, and their rewrite to the mirror ``mcore_compat.core``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["EXIT_FAIL", "EXIT_USAGE", "add_parser", "run"]

#: Exit statuses: 0 done; 1 a file could not be parsed or fixed, or (``--check``) raw imports remain; 2 bad usage.
EXIT_FAIL = 1
EXIT_USAGE = 2

_PROG = "mcore-compat scan"


def add_parser(sub: Any) -> None:
    """Register the ``scan`` subcommand."""
    p = sub.add_parser(
        "scan", help="which of a codebase's megatron.core imports work on which release; rewrite them to the mirror",
        description="Reads the megatron.core imports (at any depth, inside try/except and functions) and the "
        "attribute uses of imported modules (mpu.get_..., tensor_parallel.X) of every .py file under PATH, "
        "without importing anything, and reports per release which names import raw as written, which moved "
        "(with the mirror spelling mcore_compat.core that reaches them), which are absent (with the releases "
        "that have them), and which mcore_compat adapts by signature (with the call to use).",
        epilog="Exit status: 0 done; 1 a file does not parse or cannot be rewritten (named; the rest is still "
               "scanned), or with --check raw megatron.core imports remain; 2 bad usage (a PATH that does not "
               "exist, an unknown release).")
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or folders to scan")
    p.add_argument("--release", action="append", default=None, metavar="V",
                   help="a release to report (repeatable; default: every supported release)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--fix", action="store_true",
                   help="rewrite megatron.core to mcore_compat.core in the import lines (in place; idempotent; "
                        "formatting and comments kept; needs libcst: pip install libcst, or '.[scan]' in a checkout)")
    p.add_argument("--check", action="store_true",
                   help="exit 1 while raw megatron.core import lines remain (for a client's CI)")
    p.set_defaults(func=run)


def _fail(message: str) -> None:
    print(f"{_PROG}: {message}", file=sys.stderr)


def _releases(asked: list[str] | None) -> list[str] | None:
    from .. import surface
    from ..support import releases

    known = [str(r.version) for r in releases()]
    if not asked:
        return known
    read = set(surface.releases())
    for v in asked:
        if v not in read:
            _fail(f"unknown release {v!r}: the surface data has {surface.releases()[0]} to {surface.releases()[-1]}")
            return None
    return asked


def run(args: argparse.Namespace) -> int:
    """Scan (and with ``--fix`` rewrite) ``args.paths``; see the exit statuses of :func:`add_parser`."""
    from ..scan import classify, render, scan_paths

    paths = [Path(p) for p in args.paths]
    for path in paths:
        if not path.exists():
            _fail(f"{path}: no such file or folder")
            return EXIT_USAGE
    releases = _releases(args.release)
    if releases is None:
        return EXIT_USAGE
    status = 0
    if args.fix:
        from ..errors import MissingExtraError
        from ..scan.fix import _libcst

        try:
            _libcst()
        except MissingExtraError as exc:  # said before the report, which would bury it
            _fail(str(exc))
            return EXIT_FAIL
        status = _fix(paths)
    scan = scan_paths(paths)
    for error in scan.errors:
        if not args.fix:  # --fix named it already
            _fail(f"{error.file}: {error.reason}")
        status = EXIT_FAIL
    report = classify(scan, releases)
    print(json.dumps(report, indent=1) if args.json else render(report))
    if args.check and scan.raw_imports:
        _fail(_check_advice(scan.raw_imports))
        status = EXIT_FAIL
    return status


def _fix(paths: list[Path]) -> int:
    """Rewrite every file; one line per file that cannot be rewritten."""
    try:
        from ..scan.fix import fix_file
        from ..scan.read import python_files
    except ImportError as exc:  # pragma: no cover
        _fail(str(exc))
        return EXIT_FAIL
    status = changed = 0
    for root in paths:
        for path in python_files(root):
            try:
                changed += fix_file(path)
            except (OSError, ValueError, UnicodeDecodeError) as exc:
                _fail(f"{path}: not rewritten: {exc}")
                status = EXIT_FAIL
    print(f"{_PROG}: rewrote {changed} file{'' if changed == 1 else 's'}", file=sys.stderr)
    return status


def _check_advice(raw: list[Any]) -> str:
    """``--check``'s line: how many raw import lines remain and what clears them (``--fix`` rewrites the fixable
    ones; the others, ``import megatron.core.x`` binding the name ``megatron``, are edited by hand)."""
    fixable = [r for r in raw if r.fixable]
    by_hand = [r for r in raw if not r.fixable]
    parts = []
    if fixable:
        parts.append(f"run '{_PROG} --fix' for {len(fixable)} (first: {fixable[0].file}:{fixable[0].line})")
    if by_hand:
        first = by_hand[0]
        parts.append(f"edit {len(by_hand)} by hand, which --fix leaves because they bind the name 'megatron' "
                     f"(first: {first.file}:{first.line}: 'import {first.module}' -> 'import "
                     f"{'mcore_compat.core' + first.module[len('megatron.core'):]} as <name>' and use <name>)")
    return f"{len(raw)} raw megatron.core import lines remain: " + "; ".join(parts)
