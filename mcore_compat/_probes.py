"""Probe builders for the capability table: small, explicit checks against the installed megatron-core.

Probes that only need to know whether code *exists* read the source with ``ast`` (so a release whose module
fails to import without apex can still be probed); probes about call signatures import the object and use
``inspect.signature``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from functools import lru_cache
from pathlib import Path
from typing import Callable

__all__ = ["attr_exists", "module_exists", "param_in_signature", "source_of", "top_level_import"]


def _core_dir() -> Path:
    from .detect import detect

    return detect().path


def source_of(module: str) -> Path | None:
    """The ``.py`` file of ``module`` (a ``megatron.core...`` dotted path) inside the installed tree, or None."""
    assert module.startswith("megatron.core"), module
    rel = module.split(".")[2:]
    base = _core_dir().joinpath(*rel)
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


@lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def module_exists(module: str) -> Callable[[], bool]:
    """Probe: the module's source file exists in the installed tree (no import)."""
    return lambda: source_of(module) is not None


def attr_exists(module: str, attr: str) -> Callable[[], bool]:
    """Probe: ``module`` imports and has ``attr``."""

    def probe() -> bool:
        if source_of(module) is None:
            return False
        return hasattr(importlib.import_module(module), attr)

    return probe


def param_in_signature(module: str, qualname: str, param: str) -> Callable[[], bool]:
    """Probe: the callable ``module.qualname`` takes a parameter called ``param``."""

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


def top_level_import(module: str, imported: str) -> Callable[[], bool]:
    """Probe: ``module``'s source imports ``imported`` (or a submodule) at top level, outside ``try``."""

    def probe() -> bool:
        path = source_of(module)
        if path is None:
            return False
        for node in _tree(path).body:  # only statements at module level; a Try node is skipped
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            if any(n == imported or n.startswith(imported + ".") for n in names):
                return True
        return False

    return probe
