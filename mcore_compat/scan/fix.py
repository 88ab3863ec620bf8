"""``scan --fix``: rewrite ``megatron.core`` to ``mcore_compat.core`` in import lines, keeping everything else.

A concrete syntax tree (libcst, the ``scan`` extra) keeps formatting and comments byte for byte outside the
rewritten module names. Rewritten: ``from megatron.core[.x] import ...`` and ``import megatron.core[.x] as y``.
Left alone: ``import megatron.core.x`` without ``as`` (it binds ``megatron``, which the file then uses) and
relative imports. Rewriting an already rewritten file changes nothing.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError, MissingExtraError, ReadOnlyFileError

__all__ = ["fix_file", "fix_source"]

OLD, NEW = "megatron.core", "mcore_compat.core"


def _libcst() -> Any:
    try:
        import libcst
    except ImportError as exc:  # pragma: no cover - the scan extra is missing
        raise MissingExtraError("--fix needs libcst, which is not installed: pip install libcst (in a checkout "
                                "of mcore-compat: pip install '.[scan]'); nothing was scanned or rewritten") from exc
    return libcst


def _renamed(cst: Any, node: Any) -> Any:
    """``megatron.core.x`` as a Name/Attribute node -> ``mcore_compat.core.x`` (``None``: not Megatron's)."""
    dotted = cst.helpers.get_full_name_for_node(node)
    if dotted is None or not (dotted == OLD or dotted.startswith(OLD + ".")):
        return None
    new = NEW + dotted[len(OLD):]
    return cst.parse_expression(new)


def fix_source(source: str) -> str:
    """``source`` with its Megatron import lines pointing at the mirror (unchanged when there are none)."""
    cst = _libcst()

    class _Rewrite(cst.CSTTransformer):  # type: ignore[name-defined]
        def leave_ImportFrom(self, original: Any, updated: Any) -> Any:
            if updated.relative or updated.module is None:
                return updated
            new = _renamed(cst, updated.module)
            return updated if new is None else updated.with_changes(module=new)

        def leave_ImportAlias(self, original: Any, updated: Any) -> Any:
            # only an ``import`` statement's alias can be dotted ``megatron.core...``; without ``as`` it binds
            # ``megatron``, which the file goes on using: left for a hand edit
            if updated.asname is None:
                return updated
            new = _renamed(cst, updated.name)
            return updated if new is None else updated.with_changes(name=new)

    return str(cst.parse_module(source).visit(_Rewrite()).code)


def fix_file(path: Path) -> bool:
    """Rewrite ``path`` in place; ``True`` if it changed.

    Raises:
        OSError: it cannot be read or written (:class:`~mcore_compat.errors.ReadOnlyFileError`, also a
            ``PermissionError``, for a read-only file).
        InvalidArgumentError: it does not parse (a ``ValueError``).
        MissingExtraError: libcst is not installed (an ``ImportError``).
    """
    source = path.read_text(encoding="utf-8")
    if OLD not in source:  # nothing to rewrite: not parsed (most of a client's files)
        return False
    _libcst()  # a missing libcst is not a file that does not parse
    try:
        fixed = fix_source(source)
    except Exception as exc:  # libcst.ParserSyntaxError
        raise InvalidArgumentError(f"does not parse ({str(exc).splitlines()[0]})") from exc
    if fixed == source:
        return False
    if not path.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):  # read-only, even to root
        raise ReadOnlyFileError(f"{path} is read-only")
    with open(path, "r+", encoding="utf-8", newline="") as handle:  # fails on a read-only file before writing
        handle.write(fixed)
        handle.truncate()
    return True
