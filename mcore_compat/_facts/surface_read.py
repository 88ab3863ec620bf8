"""Static read of one Megatron-Core release's surface: its modules and every name each binds.

Used by ``scripts/gen_surface.py`` (which writes ``mcore_compat/_facts/surface_data.py`` from every release's wheel) and
by the release sessions' check of that data against the installed tree (``tests/test_surface_data_real.py``).
Nothing is imported: every file is read with ``ast``.

What is read: every ``megatron/core/**.py`` file and package directory (private ones too: a client imports
``megatron.core._rank_utils``); per module, every name a client can import from it: the names bound at module
level (into ``if``/``try``/``with`` blocks, not into ``if TYPE_CHECKING:``), public, private and dunder alike
(``__version__``, ``_fork_rng``): classes, functions, assignments, re-exports from ``megatron`` (``from
megatron.core.x import y [as z]``, relative or absolute, ``import megatron.core.x as z``, ``from x import *``),
imports from outside Megatron (``from torch.utils.checkpoint import detach_variable``, ``import torch``: kind
``import``), and the names ``__all__`` lists. A re-export has the kind of what it names (:class:`Entry`).
"""

from __future__ import annotations

import ast
import warnings
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

__all__ = ["Entry", "Release", "ReleaseSurface", "is_public", "module_of", "read_module"]

PREFIX = "megatron/core/"
_TRY: tuple[type, ...] = (ast.Try, *((ast.TryStar,) if hasattr(ast, "TryStar") else ()))

class Release:
    """The ``megatron/core`` files of one release (a wheel or an unpacked tree)."""

    def __init__(self, files: dict[str, bytes | Path]) -> None:
        self.files = files  # "megatron/core/a/b.py" -> contents, or the file to read

    @classmethod
    def from_wheel(cls, wheel: Path) -> Release:
        with zipfile.ZipFile(wheel) as zf:
            return cls({n: (zf.read(n) if n.endswith(".py") else b"") for n in zf.namelist()
                        if n.startswith(PREFIX) and (n.endswith(".py") or is_extension(n))})

    @classmethod
    def from_tree(cls, root: Path) -> Release:
        return cls({p.relative_to(root).as_posix(): p for p in (root / "megatron" / "core").rglob("*")
                    if p.suffix == ".py" or is_extension(p.name)})

    def source(self, path: str) -> str:
        data = self.files[path]
        return (data.read_bytes() if isinstance(data, Path) else data).decode("utf-8")


def is_extension(path: str) -> bool:
    """A compiled extension module (``helpers_cpp.cpython-311-x86_64-linux-gnu.so``, 0.10+'s dataset helpers):
    a module of its own, whose names cannot be read without importing it."""
    return path.endswith((".so", ".pyd"))


def module_of(path: str) -> str:
    """``megatron/core/a/b.py`` -> ``megatron.core.a.b``; ``megatron/core/a/__init__.py`` -> ``megatron.core.a``;
    ``megatron/core/a/c.cpython-311-x86_64-linux-gnu.so`` -> ``megatron.core.a.c``."""
    if is_extension(path):
        head, _, leaf = path.rpartition("/")
        path = f"{head}/{leaf.split('.')[0]}.py"
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_public(module: str) -> bool:
    return not any(part.startswith("_") for part in module.split("."))


@dataclass
class Binding:
    """What a module-level name is bound to: a definition (``kind``), or a reference (``ref``: module, name; name
    ``None`` for a module) resolved later."""

    kind: str | None = None
    ref: tuple[str, str | None] | None = None


@dataclass
class ModuleRead:
    """One module's bindings as read (before re-exports are resolved)."""

    name: str
    package: bool
    bindings: dict[str, Binding] = field(default_factory=dict)
    stars: list[str] = field(default_factory=list)  # modules of `from x import *`
    all_names: list[str] | None = None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_statements(body: Iterable[ast.stmt]) -> list[ast.stmt]:
    """The statements that run at module level, in an order where the normal path binds last: into ``if`` (not
    ``if TYPE_CHECKING:``), ``try`` (its handlers before its body: the fallback is overridden by the import that
    works), ``with``; not into defs or classes."""
    out: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, ast.If):
            out += module_statements(stmt.orelse if _is_type_checking(stmt.test) else [*stmt.orelse, *stmt.body])
        elif isinstance(stmt, _TRY):
            tried: Any = stmt  # ast.Try, or ast.TryStar (Python 3.11+)
            handlers = [s for h in tried.handlers for s in h.body]
            out += module_statements([*handlers, *tried.body, *tried.orelse, *tried.finalbody])
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            out += module_statements(stmt.body)
        else:
            out.append(stmt)
    return out


def _target_names(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for t in target.elts for n in _target_names(t)]
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    return []


def _from_module(module: str, package: bool, node: ast.ImportFrom) -> str | None:
    """The absolute module a ``from ... import`` in ``module`` names."""
    if node.level:
        base = module.split(".") if package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))
    return node.module


def _literal_names(value: ast.expr | None) -> list[str] | None:
    if isinstance(value, (ast.List, ast.Tuple)):
        return [e.value for e in value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return None


def read_module(name: str, package: bool, source: str) -> ModuleRead:
    """The module-level bindings of one file."""
    mod = ModuleRead(name, package)
    with warnings.catch_warnings():  # Megatron's own invalid escape sequences ("\\s" in docstrings)
        warnings.simplefilter("ignore", (DeprecationWarning, SyntaxWarning))
        tree = ast.parse(source)
    for stmt in module_statements(tree.body):
        binds = mod.bindings
        if isinstance(stmt, ast.ClassDef):
            binds[stmt.name] = Binding("class")
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            binds[stmt.name] = Binding("function")
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if isinstance(stmt, ast.AnnAssign) and stmt.value is None:
                continue  # an annotation binds nothing
            names = [n for t in targets for n in _target_names(t)]
            if names == ["__all__"]:
                found = _literal_names(stmt.value)
                if found is not None:
                    mod.all_names = (mod.all_names or []) + found if isinstance(stmt, ast.AugAssign) else found
                continue
            alias = stmt.value.id if isinstance(stmt.value, ast.Name) and len(names) == 1 else None
            for target in names:
                binds[target] = Binding(ref=(name, alias)) if alias and alias != target else Binding("variable")
        elif isinstance(stmt, ast.Import):
            for a in stmt.names:
                if a.asname:
                    binds[a.asname] = Binding(ref=(a.name, None)) if a.name.startswith("megatron.") \
                        else Binding("import")
                elif a.name.split(".")[0] != "megatron":  # `import torch.nn` binds torch
                    binds[a.name.split(".")[0]] = Binding("import")
        elif isinstance(stmt, ast.ImportFrom):
            source_module = _from_module(name, package, stmt)
            if source_module is None:
                continue
            internal = source_module == "megatron" or source_module.startswith("megatron.")
            for a in stmt.names:
                if a.name == "*":
                    if internal:
                        mod.stars.append(source_module)
                    continue
                binds[a.asname or a.name] = Binding(ref=(source_module, a.name)) if internal else Binding("import")
        elif isinstance(stmt, ast.Delete):
            for t in stmt.targets:
                for n in _target_names(t):
                    binds.pop(n, None)
    return mod


@dataclass(frozen=True)
class Entry:
    """A public name of a module in one release: its kind, and where it is defined (``module``, ``name``)."""

    kind: str
    origin: tuple[str, str]


class ReleaseSurface:
    """The public modules of one release and their names, re-exports resolved."""

    def __init__(self, release: Release) -> None:
        self.release = release
        self._files: dict[str, str | None] = {}  # module -> its file (None: a directory without __init__.py)
        for path in release.files:
            known = self._files.get(module_of(path))
            if known is None or (is_extension(known) and not is_extension(path)):  # a .py file wins
                self._files[module_of(path)] = path
        for name in list(self._files):
            parts = name.split(".")
            for i in range(3, len(parts)):
                self._files.setdefault(".".join(parts[:i]), None)
        self._reads: dict[str, ModuleRead] = {}
        self._resolving: set[tuple[str, str]] = set()
        self._entries: dict[tuple[str, str], Entry | None] = {}
        self._names: dict[str, dict[str, Entry]] = {}
        #: module (private ones too) -> whether it is a package
        self.modules: dict[str, bool] = {m: self._is_package(m) for m in sorted(self._files)}

    def _is_package(self, module: str) -> bool:
        path = self._files[module]
        return path is None or path.endswith("/__init__.py")

    def read(self, module: str) -> ModuleRead | None:
        """The bindings of ``module`` (parsed on first use); ``None``: no such module."""
        if module not in self._files:
            return None
        if module not in self._reads:
            path = self._files[module]
            self._reads[module] = ModuleRead(module, path is None) if path is None or is_extension(path) else \
                read_module(module, self._is_package(module), self.release.source(path))
        return self._reads[module]

    def names_of(self, module: str) -> dict[str, Entry]:
        """The importable names of one module (parsing only the files it re-exports from)."""
        if module not in self._names:
            self._names[module] = self.module_names(module)
        return self._names[module]

    @cached_property
    def names(self) -> dict[str, dict[str, Entry]]:
        """The importable names of every module (parses every file)."""
        return {m: self.names_of(m) for m in self.modules}

    def entry(self, module: str, name: str) -> Entry | None:
        """What ``module.name`` is (``None``: the module does not bind it)."""
        key = (module, name)
        if key in self._entries:
            return self._entries[key]
        if key in self._resolving:
            return None
        self._resolving.add(key)
        try:
            found = self._entry(module, name)
        finally:
            self._resolving.discard(key)
        self._entries[key] = found
        return found

    def _entry(self, module: str, name: str) -> Entry | None:
        read = self.read(module)
        if read is None:
            return None
        binding = read.bindings.get(name)
        if binding is None:
            for star in read.stars:
                if name in self.star_names(star):
                    return self.entry(star, name)
            if read.package and f"{module}.{name}" in self._files:
                return Entry("module", (f"{module}.{name}", ""))
            return None
        if binding.kind is not None:
            return Entry(binding.kind, (module, name))
        assert binding.ref is not None
        target, attr = binding.ref
        if attr is None:
            return Entry("module", (target, "")) if target in self._files else Entry("import", (target, ""))
        if f"{target}.{attr}" in self._files:
            target_read = self.read(target)
            bound = target_read.bindings.get(attr) if target_read is not None else None
            if bound is None or bound.ref == (target, attr) or bound.ref == (f"{target}.{attr}", None):
                return Entry("module", (f"{target}.{attr}", ""))
        if (target, attr) == (module, name):
            return None
        found = self.entry(target, attr)
        return found if found is not None else Entry("import", (target, attr))

    def star_names(self, module: str) -> list[str]:
        read = self.read(module)
        if read is None:
            return []
        if read.all_names is not None:
            return read.all_names
        return [n for n in read.bindings if not n.startswith("_")]

    def module_names(self, module: str) -> dict[str, Entry]:
        """Every name ``from module import name`` finds: its bindings (private, dunder and imports from outside
        Megatron included), the names its ``import *`` statements bring, the names ``__all__`` lists."""
        read = self.read(module)
        assert read is not None
        candidates = list(read.bindings)
        for star in read.stars:
            candidates += self.star_names(star)
        candidates += list(read.all_names or ())
        out: dict[str, Entry] = {}
        for name in dict.fromkeys(candidates):
            found = self.entry(module, name)
            if found is not None:
                out[name] = found
        return out
