"""Probe builders for the capability table: small, explicit checks against the installed megatron-core.

Probes that only need to know whether code *exists* (or what a ``def`` declares) read the source with ``ast``,
so a release whose module fails to import without apex/TransformerEngine can still be probed; probes about
call signatures of importable objects import the object and use ``inspect.signature``.

Every builder returns a zero-argument callable returning ``bool``. Qualified names (``qualname``) are dotted
paths inside a module: ``"DistributedDataParallel.__init__"``, ``"get_megatron_optimizer"``,
``"DistributedDataParallelConfig.bucket_size"`` (a class-body field counts as a definition).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Union

__all__ = [
    "all_of",
    "any_of",
    "asserts_name",
    "assigns_constant",
    "assigns_self_attr",
    "attr_exists",
    "calls_with_constant",
    "def_has_param",
    "defines",
    "module_exists",
    "module_level_call",
    "negate",
    "param_in_signature",
    "reads_self_attr",
    "source_of",
    "top_level_import",
]

Probe = Callable[[], bool]
_Scope = Union[ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef]
_Const = Union[int, float, str]


def _core_dir() -> Path:
    from .detect import detect

    return detect().path


def source_of(module: str) -> Path | None:
    """The ``.py`` file of ``module`` (a ``megatron.*`` dotted path) in the installed tree, or None.

    ``megatron.core...`` paths are looked up under the detected core directory; other ``megatron.*`` packages
    (e.g. ``megatron.training``, shipped in 0.17+ wheels) next to it.
    """
    assert module.startswith("megatron."), module
    rel = module.split(".")[1:]
    base = _core_dir().parent.joinpath(*rel)
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _module_tree(module: str) -> ast.Module | None:
    path = source_of(module)
    return None if path is None else _tree(path)


def _binds(stmt: ast.stmt, name: str) -> bool:
    """Whether a statement of a module/class body defines ``name`` (def, class, assignment, field)."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return stmt.name == name
    if isinstance(stmt, ast.AnnAssign):
        return isinstance(stmt.target, ast.Name) and stmt.target.id == name
    if isinstance(stmt, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets)
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return any((a.asname or a.name.split(".")[0]) == name for a in stmt.names)
    return False


def _body_statements(scope: _Scope) -> list[ast.stmt]:
    """Statements of a body, descending into ``if``/``try`` blocks (not into nested defs/classes)."""
    out: list[ast.stmt] = []
    pending = list(scope.body)
    while pending:
        stmt = pending.pop(0)
        out.append(stmt)
        if isinstance(stmt, ast.If):
            pending += stmt.body + stmt.orelse
        elif isinstance(stmt, ast.Try):
            pending += stmt.body + stmt.orelse + stmt.finalbody
            for handler in stmt.handlers:
                pending += handler.body
    return out


def _find(module: str, qualname: str) -> ast.AST | None:
    """The AST node defining ``module.qualname`` (last definition wins, like at run time)."""
    node: ast.AST | None = _module_tree(module)
    for part in qualname.split("."):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            return None
        found = [s for s in _body_statements(node) if _binds(s, part)]
        node = found[-1] if found else None
    return node


def _walk_scope(node: ast.AST) -> list[ast.AST]:
    """Every node under ``node``; when ``node`` is a module, nested defs/classes are not entered."""
    if not isinstance(node, ast.Module):
        return list(ast.walk(node))
    out: list[ast.AST] = []
    pending: list[ast.AST] = list(node.body)
    while pending:
        cur = pending.pop()
        out.append(cur)
        if not isinstance(cur, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(cur))
    return out


def _call_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


# --------------------------------------------------------------------------------------------- builders


def module_exists(module: str) -> Probe:
    """Probe: the module's source file exists in the installed tree (no import)."""
    return lambda: source_of(module) is not None


def defines(module: str, qualname: str) -> Probe:
    """Probe: ``module``'s source defines ``qualname`` (function, class, method, assignment or field; no import).

    Definitions guarded by ``if``/``try`` at module or class level count.
    """
    return lambda: _find(module, qualname) is not None


def def_has_param(module: str, qualname: str, param: str) -> Probe:
    """Probe: the ``def`` of ``module.qualname`` declares a parameter called ``param`` (read from source)."""

    def probe() -> bool:
        node = _find(module, qualname)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return False
        a = node.args
        names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
        return param in names

    return probe


def attr_exists(module: str, attr: str) -> Probe:
    """Probe: ``module`` imports and has ``attr``."""

    def probe() -> bool:
        if source_of(module) is None:
            return False
        return hasattr(importlib.import_module(module), attr)

    return probe


def param_in_signature(module: str, qualname: str, param: str) -> Probe:
    """Probe: the callable ``module.qualname`` takes a parameter called ``param`` (imports the module)."""

    def probe() -> bool:
        if source_of(module) is None:
            return False
        obj: object = importlib.import_module(module)
        for part in qualname.split("."):
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return param in inspect.signature(obj).parameters  # type: ignore[arg-type]

    return probe


def top_level_import(module: str, imported: str) -> Probe:
    """Probe: ``module``'s source imports ``imported`` (or a submodule) at top level, outside ``try``."""

    def probe() -> bool:
        tree = _module_tree(module)
        if tree is None:
            return False
        for node in tree.body:  # only statements at module level; a Try node is skipped
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            if any(n == imported or n.startswith(imported + ".") for n in names):
                return True
        return False

    return probe


def module_level_call(module: str, func: str) -> Probe:
    """Probe: ``module`` calls ``func`` while being imported (a call outside any def/class body)."""

    def probe() -> bool:
        tree = _module_tree(module)
        if tree is None:
            return False
        return any(isinstance(n, ast.Call) and _call_name(n) == func for n in _walk_scope(tree))

    return probe


def calls_with_constant(modules: tuple[str, ...], funcs: tuple[str, ...], constant: _Const,
                        within: str | None = None) -> Probe:
    """Probe: one of ``modules`` calls one of ``funcs`` (by bare or attribute name) with literal ``constant``
    among its positional arguments, optionally only inside the definition ``within`` (a qualname).

    E.g. ``math.lcm(world_size, 128)`` is ``calls_with_constant((m,), ("lcm",), 128)``.
    """

    def probe() -> bool:
        for module in modules:
            root = _find(module, within) if within else _module_tree(module)
            if root is None:
                continue
            for node in ast.walk(root):
                if isinstance(node, ast.Call) and _call_name(node) in funcs and any(
                    isinstance(arg, ast.Constant) and type(arg.value) is type(constant) and arg.value == constant
                    for arg in node.args
                ):
                    return True
        return False

    return probe


def assigns_constant(module: str, qualname: str, name: str, constant: _Const) -> Probe:
    """Probe: the body of ``module.qualname`` contains ``name = <constant>``."""

    def probe() -> bool:
        root = _find(module, qualname)
        if root is None:
            return False
        for node in ast.walk(root):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and type(node.value.value) is type(constant) and node.value.value == constant
                    and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)):
                return True
        return False

    return probe


def asserts_name(module: str, qualname: str, name: str) -> Probe:
    """Probe: the body of ``module.qualname`` has an ``assert`` whose condition mentions the name ``name``."""

    def probe() -> bool:
        root = _find(module, qualname)
        if root is None:
            return False
        return any(
            isinstance(node, ast.Assert)
            and any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node.test))
            for node in ast.walk(root)
        )

    return probe


def _self_attrs(root: ast.AST, store: bool) -> set[str]:
    ctx = ast.Store if store else ast.Load
    return {
        n.attr for n in ast.walk(root)
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ctx)
        and isinstance(n.value, ast.Name) and n.value.id == "self"
    }


def reads_self_attr(module: str, qualname: str, attr: str) -> Probe:
    """Probe: the body of ``module.qualname`` reads ``self.<attr>``."""

    def probe() -> bool:
        root = _find(module, qualname)
        return root is not None and attr in _self_attrs(root, store=False)

    return probe


def assigns_self_attr(module: str, qualname: str, attr: str) -> Probe:
    """Probe: the body of ``module.qualname`` (e.g. a whole class) assigns ``self.<attr> = ...``."""

    def probe() -> bool:
        root = _find(module, qualname)
        return root is not None and attr in _self_attrs(root, store=True)

    return probe


def any_of(*probes: Probe) -> Probe:
    """Probe: at least one of ``probes`` holds."""
    return lambda: any(p() for p in probes)


def all_of(*probes: Probe) -> Probe:
    """Probe: every one of ``probes`` holds."""
    return lambda: all(p() for p in probes)


def negate(probe: Probe) -> Probe:
    """Probe: ``probe`` does not hold."""
    return lambda: not probe()
