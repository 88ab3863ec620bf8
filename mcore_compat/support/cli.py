"""``python -m mcore_compat.support {render,status,list}``: the support matrix from the command line."""

from __future__ import annotations

import argparse
import json
import sys

from .files import README_FILE, writable_dir
from .matrix import Matrix

__all__ = ["main"]

_DESCRIPTION = "The support matrix: which Megatron-Core releases mcore-compat supports, on what, and how they fared."


def _cmd_render(args: argparse.Namespace) -> int:
    target = writable_dir(args.matrix_dir)
    matrix = Matrix(target, results_dir=target)
    readme = target / README_FILE
    if args.check:
        current = readme.read_text(encoding="utf-8") if readme.is_file() else ""
        if current != matrix.render_table():
            print(f"{readme} is stale: run `python -m mcore_compat.support render`", file=sys.stderr)
            return 1
        print(f"{readme} is up to date")
        return 0
    print(f"wrote {matrix.write_readme()}")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    st = Matrix(args.matrix_dir).status(args.version)
    print(json.dumps(st.as_dict(), indent=2) if args.json else st.summary())
    return 0 if st.listed else 1


def _cmd_list(args: argparse.Namespace) -> int:
    for r in Matrix(args.matrix_dir).releases():
        limits = ",".join(f"{'python' if k == 'requires_python' else k}{v}" for k, v in r.limits().items())
        print(f"{r.version!s:<8} python {r.python}  {r.session:<14} limits={limits or '-'}  tags={','.join(r.tags)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m mcore_compat.support {render,status,list}``."""
    args = _build_parser().parse_args(argv)
    return int(args.func(args))


def _build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m mcore_compat.support``."""
    parser = argparse.ArgumentParser(prog="python -m mcore_compat.support", description=_DESCRIPTION)
    parser.add_argument("--matrix-dir", default=None, help="the matrix/ directory (default: the source tree's)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("render", help="regenerate matrix/README.md in the source tree")
    p.add_argument("--check", action="store_true", help="exit 1 if matrix/README.md is stale, write nothing")
    p.set_defaults(func=_cmd_render)
    p = sub.add_parser("status", help="is VERSION supported? (exit 1 unless it is a listed release)")
    p.add_argument("version", help="a megatron-core version, e.g. 0.16.1")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.set_defaults(func=_cmd_status)
    sub.add_parser("list", help="the listed releases, with the Python they are tested on and their limits "
                                "(python, torch, numpy, setuptools)").set_defaults(func=_cmd_list)
    return parser
