"""Every exception class mcore-compat defines derives from :class:`mcore_compat.McoreCompatError`, and every
``raise`` in the package raises one of them (bar the protocol exceptions listed below), so that ``except
McoreCompatError`` catches whatever the library raises on purpose."""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import inspect
import pkgutil
import typing
from pathlib import Path
from types import ModuleType

import pytest

from mcore_compat.errors import McoreCompatError

pytestmark = pytest.mark.unit

#: Modules not imported by the walk: importing a ``__main__`` (``python -m mcore_compat``, ``python -m
#: mcore_compat.support``) runs its command line.
_NOT_IMPORTED = frozenset({"mcore_compat.__main__", "mcore_compat.support.__main__"})


#: ``raise`` statements that may name an exception outside McoreCompatError: ``(module, enclosing function's
#: qualified name, exception)`` -> why. These are protocols of the language, not errors of mcore-compat.
_PROTOCOL_RAISES: dict[tuple[str, str, str], str] = {
    ("mcore_compat", "__getattr__", "AttributeError"):
        "a module's __getattr__ (PEP 562) says 'no such attribute' with AttributeError; hasattr() and "
        "from-imports rely on it",
    ("mcore_compat.capabilities", "__getattr__", "AttributeError"):
        "the module __getattr__ that answers the deprecated name Capability says 'no such attribute' for others",
    ("mcore_compat.layout.version", "__getattr__", "AttributeError"):
        "the module __getattr__ that answers the deprecated name MIN_VERSION says 'no such attribute' for others",
    ("mcore_compat._facts.mirror", "MirrorModule.__getattr__", "AttributeError"):
        "a mirror module answers dunder lookups (``__path__``, ``__file__``, ...) like any module: AttributeError, "
        "so the import system, copy and hasattr() work; a missing Megatron name raises NameUnavailableError",
    ("mcore_compat.symbols", "Unavailable.__getattr__", "AttributeError"):
        "the placeholder answers dunder lookups like a plain object (copy, pickle, hasattr probe them and expect "
        "AttributeError)",
    ("mcore_compat.__main__", "<module>", "SystemExit"): "python -m mcore_compat: the exit status of the command",
    ("mcore_compat.support.__main__", "<module>", "SystemExit"):
        "python -m mcore_compat.support: the exit status of the command",
    ("mcore_compat.launch", "check_not_bootstrapping", "SystemExit"):
        "a rank still being bootstrapped by multiprocessing re-ran the caller's main script: it ends with a status "
        "the parent turns into a RankFailure naming the missing __main__ guard (an exception would only print "
        "multiprocessing's bootstrap error in every rank)",
    ("mcore_compat.checkpoint.files", "_exchange", "OSError"):
        "renameat2's errno raised as the OSError os.rename would raise; the save's describe() turns it into the one "
        "line of the CheckpointError every rank raises",
    ("mcore_compat.checkpoint.save", "_start", "NotADirectoryError"):
        "the OSError (ENOTDIR) mkdir would raise for a path that is a file, raised before anything is written; "
        "describe() turns it into the one line of the CheckpointError every rank raises",
    ("mcore_compat.checkpoint.save", "_Save.write", "OSError"):
        "torch's zip writer reports a full disk as a RuntimeError: re-raised as the ENOSPC OSError it is, caught "
        "two lines below and described (bytes needed and free) in the CheckpointError every rank raises",
}


def _module_names() -> list[str]:
    """Every module of the installed layout: ``mcore_compat`` and its subpackages, ``mcore_compat.patches``
    included (in a source checkout ``patches/`` lies beside the package, not inside it)."""
    import mcore_compat.patches

    roots = [([str(Path(mcore_compat.__file__).parent)], "mcore_compat."),
             (list(mcore_compat.patches.__path__), "mcore_compat.patches.")]
    names = {"mcore_compat", "mcore_compat.patches"}
    for path, prefix in roots:
        names.update(info.name for info in pkgutil.walk_packages(path, prefix))
    return sorted(names - _NOT_IMPORTED)


def _all_module_names() -> list[str]:
    """:func:`_module_names` and the ``__main__`` modules (read, not imported)."""
    return sorted({*_module_names(), *_NOT_IMPORTED})


def _resolve(node: ast.expr, module: ModuleType | None, local_imports: dict[str, object]) -> object:
    """The object a ``raise`` names (``Name`` or ``a.b.Name``, called or not), looked up in the enclosing functions'
    imports, the module's globals, then builtins; ``None`` if it cannot be resolved statically (a local variable, a
    call of a function...)."""
    if isinstance(node, ast.Call):
        node = node.func
    path: list[str] = []
    while isinstance(node, ast.Attribute):
        path.insert(0, node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    namespace = {**(vars(module) if module is not None else {}), **local_imports}
    obj = namespace.get(node.id, getattr(builtins, node.id, None))
    for attr in path:
        obj = getattr(obj, attr, None)
    return obj


def _returns_our_error(function: object) -> bool:
    """Whether ``function``'s return annotation is a McoreCompatError subclass."""
    try:
        returned = typing.get_type_hints(function).get("return")
    except Exception:  # an annotation that does not resolve: not ours
        return False
    return inspect.isclass(returned) and issubclass(returned, McoreCompatError)


def _local_imports(function: ast.AST, package: str) -> dict[str, object]:
    """The names bound by ``from X import Y`` inside a function's body (an import deferred into the function)."""
    names: dict[str, object] = {}
    for node in ast.walk(function):
        if isinstance(node, ast.ImportFrom):
            source = importlib.import_module("." * node.level + (node.module or ""), package)
            for alias in node.names:
                names[alias.asname or alias.name] = getattr(source, alias.name, None)
    return names


def _raises(name: str) -> list[tuple[str, int, str, ast.expr, dict[str, object]]]:
    """``(enclosing qualified name, line, source text, raised expression, imports of the enclosing functions)`` of
    every ``raise X``/``raise X(...)`` of module ``name`` (a bare ``raise`` re-raises and is left out)."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None, name
    package = name if spec.submodule_search_locations is not None else name.rpartition(".")[0]
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"), filename=spec.origin)
    found: list[tuple[str, int, str, ast.expr, dict[str, object]]] = []

    def visit(node: ast.AST, scope: list[str], local: dict[str, object]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, [*scope, child.name], {**local, **_local_imports(child, package)})
            elif isinstance(child, ast.ClassDef):
                visit(child, [*scope, child.name], local)
            else:
                if isinstance(child, ast.Raise) and child.exc is not None:
                    found.append((".".join(scope) or "<module>", child.lineno, ast.unparse(child.exc), child.exc,
                                  local))
                visit(child, scope, local)

    visit(tree, [], {})
    return found


def _exception_classes() -> dict[str, type[BaseException]]:
    """``"module.Class"`` -> every exception class defined at the top level of a module of the package."""
    found: dict[str, type[BaseException]] = {}
    for name in _module_names():
        module = importlib.import_module(name)
        for attr, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == name:
                found[f"{name}.{attr}"] = obj
    return found


def test_every_exception_class_derives_from_mcore_compat_error() -> None:
    classes = _exception_classes()
    # the walk sees the package's modules, not just the top level (guards against an empty, vacuous walk)
    for known in ("mcore_compat.errors.PatchRefusedError", "mcore_compat.launch.RankFailure",
                  "mcore_compat.launch.RankTimeout", "mcore_compat.selfcheck.options.UsageError",
                  "mcore_compat.patches._targets._NotInstalled"):
        assert known in classes, f"the module walk did not find {known} (found: {sorted(classes)})"
    outside = sorted(name for name, cls in classes.items() if not issubclass(cls, McoreCompatError))
    assert not outside, f"exception classes outside McoreCompatError (mcore_compat/errors.py): {outside}"


def test_errors_keep_their_standard_bases() -> None:
    """Code written against the standard bases keeps working (``except RuntimeError`` / ``except ValueError``)."""
    from mcore_compat.launch import RankFailure, RankTimeout
    from mcore_compat.selfcheck.options import SelfCheckOptions, UsageError

    assert issubclass(RankFailure, RuntimeError) and issubclass(RankTimeout, RuntimeError)
    assert issubclass(UsageError, ValueError)
    with pytest.raises(ValueError, match="--nproc must be >= 1"):
        SelfCheckOptions(nproc=0).resolved()


def test_every_raise_names_a_mcore_compat_error() -> None:
    """An AST walk over every module of mcore_compat and its patches: each ``raise`` names a class deriving from
    McoreCompatError, or is one of the protocol raises of ``_PROTOCOL_RAISES``."""
    bad: list[str] = []
    seen_protocol: set[tuple[str, str, str]] = set()
    total = 0
    for name in _all_module_names():
        module = None if name in _NOT_IMPORTED else importlib.import_module(name)
        for scope, line, text, exc, local_imports in _raises(name):
            total += 1
            target = _resolve(exc, module, local_imports)
            if inspect.isclass(target) and issubclass(target, McoreCompatError):
                continue
            if inspect.isfunction(target) and isinstance(exc, ast.Call) and _returns_our_error(target):
                continue  # ``raise _error_for(x)``: a function that builds the exception
            key = (name, scope, getattr(target, "__name__", text))
            if key in _PROTOCOL_RAISES:
                seen_protocol.add(key)
                continue
            bad.append(f"{name}:{line} ({scope}): raise {text}")
    assert total > 100, f"the walk found only {total} raise statements (a vacuous walk?)"
    assert not bad, ("raise statements outside McoreCompatError (use a class of mcore_compat/errors.py, e.g. "
                     "InvalidArgumentError for a ValueError, or list a protocol raise in _PROTOCOL_RAISES):\n"
                     + "\n".join(bad))
    stale = sorted(set(_PROTOCOL_RAISES) - seen_protocol)
    assert not stale, f"_PROTOCOL_RAISES lists raises that no longer exist: {stale}"


def test_new_errors_keep_their_standard_bases() -> None:
    """The classes that replaced builtin raises are still caught by ``except`` of the builtin."""
    from mcore_compat.errors import (
        InvalidArgumentError,
        InvalidTypeError,
        NotFoundError,
        UnknownFactError,
        UnsupportedFeatureError,
    )
    from mcore_compat.support import MatrixFileError, MatrixNotFoundError

    for cls, base in ((InvalidArgumentError, ValueError), (InvalidTypeError, TypeError), (NotFoundError, KeyError),
                      (UnknownFactError, KeyError), (UnsupportedFeatureError, NotImplementedError),
                      (MatrixFileError, ValueError), (MatrixNotFoundError, FileNotFoundError)):
        assert issubclass(cls, McoreCompatError) and issubclass(cls, base), cls
    assert issubclass(UnknownFactError, NotFoundError)
    assert str(NotFoundError("no buffer x")) == "no buffer x"  # the message, not KeyError's repr() of it
    with pytest.raises(ValueError, match="nprocs must be >= 1"):
        from mcore_compat.launch import Group

        Group(0)


def test_support_errors_when_loaded_on_its_own() -> None:
    """``noxfile.py`` loads ``mcore_compat/support`` from its files as a package of another name (no mcore_compat
    above it): its errors still derive from McoreCompatError (errors.py loaded from its file) and the builtins."""
    import sys

    package = Path(str(importlib.import_module("mcore_compat.support").__file__)).parent
    name = "_mcore_compat_support_test_standalone"
    spec = importlib.util.spec_from_file_location(name, package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        errors = sys.modules[f"{name}.errors"]
        assert errors.McoreCompatError.__name__ == "McoreCompatError"
        assert issubclass(errors.NotFoundError, errors.McoreCompatError) and issubclass(errors.NotFoundError, KeyError)
        assert issubclass(module.MatrixFileError, errors.McoreCompatError)
        with pytest.raises(errors.InvalidArgumentError, match="kind must be one of"):
            matrix = module.Matrix()
            matrix.record_result(matrix.releases()[0].version, "tpu", {"result": "pass"})
    finally:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]
