"""Fingerprints of the Megatron code a patch changes, and the check that the installed code is what it was written for.

A patch that replaces or wraps Megatron code names its *targets*: ``"megatron.core.parallel_state:
destroy_model_parallel"`` (a function or class, ``Class.method`` for a method) or a whole module
(``"megatron.core.inference.unified_memory"``). A target's *fingerprint* is a hash of its normalised source:
the syntax tree of every definition of that name at the module's top level (also inside top-level ``if`` / ``try``
blocks, where Megatron defines fallbacks), without docstrings, comments or formatting. ``None`` means the target
does not exist.

``patches/_fingerprints.py`` records, per patch, target and release, the fingerprint of the real release's code
(generated from the wheels by ``scripts/fingerprint_patches.py``). :func:`refusal` compares the installed code
with it: a target whose fingerprint is none of the recorded ones refuses the patch. It reads the source file
without importing it (before ``import megatron.core``) or the file of the loaded module; when the module is
imported later, :func:`loaded_refusal` checks again against what was really loaded.
"""

from __future__ import annotations

import ast
import hashlib
import sys
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import InvalidArgumentError, MegatronNotFoundError

#: Fields of the syntax tree that are not code: left out of the fingerprint (``type_params`` is always empty in
#: Megatron's code but only exists on Python >= 3.12).
_IGNORED_FIELDS = frozenset({"ctx", "type_comment", "kind", "type_params"})
_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def split_target(target: str) -> tuple[str, str | None]:
    """``"pkg.mod:Class.method"`` -> ``("pkg.mod", "Class.method")``; ``"pkg.mod"`` -> ``("pkg.mod", None)``."""
    module, _, qualname = target.partition(":")
    return module, (qualname or None)


def module_relpath(module: str) -> list[str]:
    """Where the file of ``megatron.core.<x>`` may be, relative to the ``megatron/core`` directory."""
    parts = module.split(".")
    if parts[:2] != ["megatron", "core"]:
        raise InvalidArgumentError(f"a patch target must be in megatron.core, not {module!r}")
    rel = "/".join(parts[2:])
    return [f"{rel}.py", f"{rel}/__init__.py"] if rel else ["__init__.py"]


def _strip_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[1:]
    return body


def _canonical(node: Any) -> str:
    """A dump of the tree that is the same on every Python from 3.10: no docstrings, no empty fields."""
    if isinstance(node, list):
        return "[" + ",".join(_canonical(n) for n in node) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    fields = []
    for name, value in ast.iter_fields(node):
        if name in _IGNORED_FIELDS or value is None or value == []:
            continue
        if name == "body" and isinstance(node, (*_DEFINITIONS, ast.Module)):
            value = _strip_docstring(value)
        fields.append(f"{name}={_canonical(value)}")
    return f"{type(node).__name__}({','.join(fields)})"


def _top_level(body: Iterable[ast.stmt]) -> Iterable[ast.stmt]:
    """Statements of a module or class body, looking into ``if`` / ``try`` blocks (conditional definitions)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If):
            yield from _top_level(stmt.body)
            yield from _top_level(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, *(h.body for h in stmt.handlers), stmt.orelse, stmt.finalbody):
                yield from _top_level(block)


def _definitions(body: Iterable[ast.stmt], name: str) -> list[ast.stmt]:
    return [s for s in _top_level(body) if isinstance(s, _DEFINITIONS) and s.name == name]


def fingerprint(source: str | None, qualname: str | None) -> str | None:
    """The fingerprint of ``qualname`` in a module's ``source`` (the whole module if ``qualname`` is ``None``);
    ``None`` if the module or the name does not exist."""
    if source is None:
        return None
    with warnings.catch_warnings():  # e.g. invalid escape sequences in Megatron's docstrings (Python >= 3.12)
        warnings.simplefilter("ignore", SyntaxWarning)
        tree = ast.parse(source)
    if qualname is None:
        nodes: list[Any] = [tree]
    else:
        scopes: list[ast.stmt] = list(tree.body)
        nodes = []
        parts = qualname.split(".")
        for depth, part in enumerate(parts):
            nodes = _definitions(scopes, part)
            if depth < len(parts) - 1:
                scopes = [s for n in nodes if isinstance(n, ast.ClassDef) for s in n.body]
        if not nodes:
            return None
    return hashlib.sha256(_canonical(nodes).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------- the installed code
class _NotInstalled(MegatronNotFoundError):
    """No megatron-core on ``sys.path``: nothing to compare yet."""


def _installed_source(module: str) -> tuple[str | None, str]:
    """The source text of ``module`` as it will be (or was) imported, and where it is (``None``: no such file).

    Raises:
        _NotInstalled: no megatron-core is installed at all.
    """
    loaded = getattr(sys.modules.get(module), "__file__", None)
    if loaded:
        return _read(Path(loaded)), str(loaded)
    from ..detect import _locate_core_dir

    try:
        core = _locate_core_dir()
    except MegatronNotFoundError as exc:
        raise _NotInstalled(str(exc)) from None
    for rel in module_relpath(module):
        if (core / rel).is_file():
            return _read(core / rel), str(core / rel)
    return None, str(core / module_relpath(module)[0])


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return None


def installed_fingerprint(target: str) -> tuple[str | None, str]:
    """The fingerprint of ``target`` in the installed megatron-core, and the file it was read from.

    Raises:
        _NotInstalled: no megatron-core is installed.
    """
    module, qualname = split_target(target)
    source, where = _installed_source(module)
    return fingerprint(source, qualname), where


def _known(table: Mapping[str, str | None]) -> str:
    by_fp: dict[str | None, list[str]] = {}
    for release, fp in table.items():
        by_fp.setdefault(fp, []).append(release)
    return "; ".join(f"{fp or 'absent'} in {', '.join(releases)}" for fp, releases in by_fp.items())


def _message(name: str, target: str, version: Any, fp: str | None, where: str,
             table: Mapping[str, str | None]) -> str:
    found = f"fingerprint {fp}" if fp else "not found"
    return (f"patch {name!r} refused: its target {target} in megatron-core {version} ({where}; {found}) is not the "
            f"code the patch was written for (known: {_known(table)}). Check the patch against this code and "
            f"regenerate patches/_fingerprints.py with scripts/fingerprint_patches.py, or run without the patch.")


def refusal(name: str, targets: Iterable[str], version: Any,
            table: Mapping[str, Mapping[str, str | None]]) -> str | None:
    """Why patch ``name`` must not be applied to the installed megatron-core (``None``: every target is code the
    patch was written for, or megatron-core is not installed, which leaves the check to :func:`loaded_refusal`).
    ``table`` is the patch's part of ``FINGERPRINTS``."""
    for target in targets:
        known = table.get(target)
        if not known:
            return (f"patch {name!r} refused: patches/_fingerprints.py has no fingerprints for its target {target}; "
                    f"run scripts/fingerprint_patches.py")
        try:
            fp, where = installed_fingerprint(target)
        except _NotInstalled:
            return None
        if fp not in known.values():
            return _message(name, target, version, fp, where, known)
    return None


def loaded_refusal(name: str, targets: Iterable[str], module: ModuleType, version: Any,
                   table: Mapping[str, Mapping[str, str | None]]) -> str | None:
    """:func:`refusal` for the targets in ``module``, read from the file the module was loaded from."""
    file = getattr(module, "__file__", None)
    source = _read(Path(file)) if file else None
    for target in targets:
        mod, qualname = split_target(target)
        if mod != module.__name__:
            continue
        known = table.get(target) or {}
        fp = fingerprint(source, qualname)
        if fp not in known.values():
            return _message(name, target, version, fp, str(getattr(module, "__file__", module.__name__)), known)
    return None
