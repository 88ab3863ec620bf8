"""Probe builders for the fact table: small, explicit checks against the installed megatron-core.

Probes that only need to know whether code *exists* (or what a ``def`` declares) read the source with ``ast``,
so a release whose module fails to import without apex/TransformerEngine can still be probed; probes about
call signatures of importable objects import the object and use ``inspect.signature``.

Every builder returns a :class:`Probe`: a zero-argument callable returning the value it observes (``bool`` for
the checks, a tuple of names or a label for the value probes) that also records which modules it reads
(``probe.modules``), so a fact can name its Megatron file. Qualified names (``qualname``) are dotted paths
inside a module: ``"DistributedDataParallel.__init__"``, ``"get_megatron_optimizer"``,
``"DistributedDataParallelConfig.bucket_size"`` (a class-body field counts as a definition).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path
from typing import Generic, TypeVar, Union

from ..detect import detect

__all__ = [
    "Probe",
    "all_of",
    "any_of",
    "asserts_name",
    "assigns_constant",
    "assigns_name",
    "assigns_self_attr",
    "attr_exists",
    "calls_with_constant",
    "class_fields",
    "def_has_param",
    "def_params",
    "defines",
    "first_of",
    "module_exists",
    "module_level_call",
    "negate",
    "param_in_signature",
    "reads_attr",
    "reads_self_attr",
    "source_of",
    "top_level_import",
    "uses_string",
]

V = TypeVar("V")
_Scope = Union[ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef]
_Const = Union[int, float, str]


class Probe(Generic[V]):
    """A zero-argument check of the installed megatron-core that knows which modules it reads.

    Args:
        fn: returns the observed value.
        modules: dotted ``megatron.*`` modules ``fn`` reads (shown as the fact's source files).
    """

    __slots__ = ("_fn", "modules")

    def __init__(self, fn: Callable[[], V], modules: Iterable[str]) -> None:
        self._fn = fn
        self.modules: tuple[str, ...] = tuple(dict.fromkeys(modules))

    def __call__(self) -> V:
        return self._fn()

    def __repr__(self) -> str:
        return f"<probe of {', '.join(self.modules) or 'nothing'}>"


def _core_dir() -> Path:
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


def module_tree(module: str) -> ast.Module | None:
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


def find_node(module: str, qualname: str) -> ast.AST | None:
    """The AST node defining ``module.qualname`` (last definition wins, like at run time)."""
    node: ast.AST | None = module_tree(module)
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


def call_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


# --------------------------------------------------------------------------------------------- builders


def module_exists(module: str) -> Probe[bool]:
    """Probe: the module's source file exists in the installed tree (no import)."""
    return Probe(lambda: source_of(module) is not None, (module,))


def defines(module: str, qualname: str) -> Probe[bool]:
    """Probe: ``module``'s source defines ``qualname`` (function, class, method, assignment or field; no import).

    Definitions guarded by ``if``/``try`` at module or class level count.
    """
    return Probe(lambda: find_node(module, qualname) is not None, (module,))


def _def_params(module: str, qualname: str) -> tuple[str, ...] | None:
    node = find_node(module, qualname)
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    a = node.args
    return tuple(x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs))


def def_has_param(module: str, qualname: str, param: str) -> Probe[bool]:
    """Probe: the ``def`` of ``module.qualname`` declares a parameter called ``param`` (read from source)."""
    return Probe(lambda: param in (_def_params(module, qualname) or ()), (module,))


def def_params(module: str, qualname: str, drop: int = 0) -> Probe[tuple[str, ...] | None]:
    """Probe: the parameter names the ``def`` of ``module.qualname`` declares, in order, without the first
    ``drop`` (``self``, or arguments every release takes); ``None`` if there is no such ``def``. Read from
    source, so modules that need apex or TransformerEngine to import can be probed."""

    def probe() -> tuple[str, ...] | None:
        params = _def_params(module, qualname)
        return None if params is None else params[drop:]

    return Probe(probe, (module,))


def class_fields(module: str, qualname: str) -> Probe[tuple[str, ...] | None]:
    """Probe: the annotated fields of the class ``module.qualname`` (a dataclass), in order; ``None`` if absent."""

    def probe() -> tuple[str, ...] | None:
        node = find_node(module, qualname)
        if not isinstance(node, ast.ClassDef):
            return None
        return tuple(s.target.id for s in _body_statements(node)
                     if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name))

    return Probe(probe, (module,))


def first_of(cases: tuple[tuple[V, Probe[bool]], ...], default: V) -> Probe[V]:
    """Probe: the label of the first ``(label, check)`` whose check holds, else ``default``."""

    def probe() -> V:
        return next((label for label, check in cases if check()), default)

    return Probe(probe, (m for _, check in cases for m in check.modules))


def attr_exists(module: str, attr: str) -> Probe[bool]:
    """Probe: ``module`` imports and has ``attr``."""

    def probe() -> bool:
        if source_of(module) is None:
            return False
        return hasattr(importlib.import_module(module), attr)

    return Probe(probe, (module,))


def param_in_signature(module: str, qualname: str, param: str) -> Probe[bool]:
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

    return Probe(probe, (module,))


def top_level_import(module: str, imported: str) -> Probe[bool]:
    """Probe: ``module``'s source imports ``imported`` (or a submodule) at top level, outside ``try``."""

    def probe() -> bool:
        tree = module_tree(module)
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

    return Probe(probe, (module,))


def module_level_call(module: str, func: str) -> Probe[bool]:
    """Probe: ``module`` calls ``func`` while being imported (a call outside any def/class body)."""

    def probe() -> bool:
        tree = module_tree(module)
        if tree is None:
            return False
        return any(isinstance(n, ast.Call) and call_name(n) == func for n in _walk_scope(tree))

    return Probe(probe, (module,))


def _literal(node: ast.AST) -> object:
    """The value of a literal argument: a constant, or a power/product of int constants (``2**16``); else a
    marker that equals nothing."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Pow, ast.Mult)):
        left, right = _literal(node.left), _literal(node.right)
        if type(left) is int and type(right) is int and (isinstance(node.op, ast.Mult) or 0 <= right <= 64):
            return left ** right if isinstance(node.op, ast.Pow) else left * right
    return _NOT_LITERAL


_NOT_LITERAL = object()


def calls_with_constant(modules: tuple[str, ...], funcs: tuple[str, ...], constant: _Const,
                        within: str | None = None) -> Probe[bool]:
    """Probe: one of ``modules`` calls one of ``funcs`` (by bare or attribute name) with literal ``constant``
    among its positional arguments, optionally only inside the definition ``within`` (a qualname). An int
    constant also matches a power or product of int literals (``2**16`` is 65536).

    E.g. ``math.lcm(world_size, 128)`` is ``calls_with_constant((m,), ("lcm",), 128)``.
    """

    def probe() -> bool:
        for module in modules:
            root = find_node(module, within) if within else module_tree(module)
            if root is None:
                continue
            for node in ast.walk(root):
                if isinstance(node, ast.Call) and call_name(node) in funcs and any(
                    type(value) is type(constant) and value == constant
                    for value in map(_literal, node.args)
                ):
                    return True
        return False

    return Probe(probe, modules)


def assigns_constant(module: str, qualname: str, name: str, constant: _Const) -> Probe[bool]:
    """Probe: the body of ``module.qualname`` contains ``name = <constant>``."""

    def probe() -> bool:
        root = find_node(module, qualname)
        if root is None:
            return False
        for node in ast.walk(root):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and type(node.value.value) is type(constant) and node.value.value == constant
                    and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)):
                return True
        return False

    return Probe(probe, (module,))


def assigns_name(module: str, qualname: str, name: str) -> Probe[bool]:
    """Probe: the body of ``module.qualname`` binds the local name ``name`` (any assignment target, tuples too)."""

    def probe() -> bool:
        root = find_node(module, qualname)
        return root is not None and any(
            isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store) for n in ast.walk(root))

    return Probe(probe, (module,))


def asserts_name(module: str, qualname: str, name: str) -> Probe[bool]:
    """Probe: the body of ``module.qualname`` has an ``assert`` whose condition mentions the name ``name``."""

    def probe() -> bool:
        root = find_node(module, qualname)
        if root is None:
            return False
        return any(
            isinstance(node, ast.Assert)
            and any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node.test))
            for node in ast.walk(root)
        )

    return Probe(probe, (module,))


def uses_string(module: str, qualname: str, text: str) -> Probe[bool]:
    """Probe: the body of ``module.qualname`` contains the string constant ``text`` (e.g. a dict key it reads)."""

    def probe() -> bool:
        root = find_node(module, qualname)
        return root is not None and any(
            isinstance(n, ast.Constant) and n.value == text for n in ast.walk(root))

    return Probe(probe, (module,))


def _self_attrs(root: ast.AST, store: bool) -> set[str]:
    ctx = ast.Store if store else ast.Load
    return {
        n.attr for n in ast.walk(root)
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ctx)
        and isinstance(n.value, ast.Name) and n.value.id == "self"
    }


def reads_self_attr(module: str, qualname: str, attr: str) -> Probe[bool]:
    """Probe: the body of ``module.qualname`` reads ``self.<attr>``."""

    def probe() -> bool:
        root = find_node(module, qualname)
        return root is not None and attr in _self_attrs(root, store=False)

    return Probe(probe, (module,))


def reads_attr(module: str, qualname: str, name: str, attr: str) -> Probe[bool]:
    """Probe: the body of ``module.qualname`` reads ``<name>.<attr>`` (e.g. ``config.virtual_pipeline_...``)."""

    def probe() -> bool:
        root = find_node(module, qualname)
        return root is not None and any(
            isinstance(n, ast.Attribute) and n.attr == attr and isinstance(n.value, ast.Name) and n.value.id == name
            for n in ast.walk(root))

    return Probe(probe, (module,))


def assigns_self_attr(module: str, qualname: str, attr: str) -> Probe[bool]:
    """Probe: the body of ``module.qualname`` (e.g. a whole class) assigns ``self.<attr> = ...``."""

    def probe() -> bool:
        root = find_node(module, qualname)
        return root is not None and attr in _self_attrs(root, store=True)

    return Probe(probe, (module,))


def _modules(probes: tuple[Probe[bool], ...]) -> list[str]:
    return [m for p in probes for m in p.modules]


def any_of(*probes: Probe[bool]) -> Probe[bool]:
    """Probe: at least one of ``probes`` holds."""
    return Probe(lambda: any(p() for p in probes), _modules(probes))


def all_of(*probes: Probe[bool]) -> Probe[bool]:
    """Probe: every one of ``probes`` holds."""
    return Probe(lambda: all(p() for p in probes), _modules(probes))


def negate(probe: Probe[bool]) -> Probe[bool]:
    """Probe: ``probe`` does not hold."""
    return Probe(lambda: not probe(), probe.modules)
