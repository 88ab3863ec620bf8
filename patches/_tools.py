"""Building blocks for patches that can be undone exactly.

Every helper here returns an :data:`Undo` (a no-argument function) that restores precisely what it changed:
attributes (including "was not set on this object, only inherited"), ``sys.modules`` entries, environment
variables, ``sys.meta_path`` entries. :class:`Changes` collects several of them and undoes them newest first.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

Undo = Callable[[], None]

_MISSING: Any = object()


class Changes:
    """A stack of undo functions; :meth:`undo` runs them newest first (each once)."""

    def __init__(self) -> None:
        self._undos: list[Undo] = []

    def add(self, undo: Undo) -> None:
        """Record an undo function."""
        self._undos.append(undo)

    def setattr(self, obj: Any, name: str, value: Any) -> None:
        """Set ``obj.name = value`` and record how to restore it exactly."""
        self.add(set_attr(obj, name, value))

    def undo(self) -> None:
        """Undo everything recorded, newest first."""
        while self._undos:
            self._undos.pop()()


def set_attr(obj: Any, name: str, value: Any) -> Undo:
    """Set ``obj.name = value``; the undo restores the previous own value, or deletes the attribute if it was
    only inherited (from a class or base class) or absent."""
    own = vars(obj) if hasattr(obj, "__dict__") else {}
    old = own.get(name, _MISSING)
    setattr(obj, name, value)

    def undo() -> None:
        if old is _MISSING:
            if name in vars(obj):
                delattr(obj, name)
        else:
            setattr(obj, name, old)

    return undo


def set_env(name: str, value: str) -> Undo:
    """Set the environment variable ``name``; the undo restores its old value or unsets it."""
    old = os.environ.get(name)
    os.environ[name] = value

    def undo() -> None:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old

    return undo


def new_module(name: str, *, package: bool = False, doc: str = "", **attrs: Any) -> types.ModuleType:
    """A fresh module object with a proper ``__spec__`` (so ``importlib.util.find_spec`` works on it).

    ``package=True`` gives it an empty ``__path__``: importing a submodule that was not installed explicitly then
    fails with ``ModuleNotFoundError``, as it would for a real package that lacks it.
    """
    mod = types.ModuleType(name, doc)
    spec = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        spec.submodule_search_locations = []
        mod.__path__ = []
    mod.__spec__ = spec
    mod.__loader__ = None
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


def install_modules(modules: Sequence[types.ModuleType]) -> Undo:
    """Put ``modules`` into ``sys.modules`` (and bind each as an attribute of its parent, when the parent is one of
    ``modules``). The undo removes exactly those entries (restoring any entry they replaced)."""
    changes = Changes()
    by_name = {m.__name__: m for m in modules}
    for mod in modules:
        old = sys.modules.get(mod.__name__, _MISSING)
        sys.modules[mod.__name__] = mod

        def undo(name: str = mod.__name__, old: Any = old, mod: types.ModuleType = mod) -> None:
            if sys.modules.get(name) is mod:
                del sys.modules[name]
            if old is not _MISSING:
                sys.modules[name] = old

        changes.add(undo)
        parent, _, child = mod.__name__.rpartition(".")
        if parent in by_name:
            setattr(by_name[parent], child, mod)
    return changes.undo


class _HookLoader(importlib.abc.Loader):
    """Wraps a loader: runs ``callback(module)`` right after the module body has executed."""

    def __init__(self, inner: Any, callback: Callable[[types.ModuleType], None]) -> None:
        self._inner = inner
        self._callback = callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        self._callback(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package, ... of the real loader
        return getattr(self._inner, name)


class _ImportHook(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that does not find anything itself: it wraps the loader of one module."""

    def __init__(self, module_name: str, callback: Callable[[types.ModuleType], None]) -> None:
        self.module_name = module_name
        self._callback = callback
        self._local = threading.local()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.module_name or getattr(self._local, "busy", False):
            return None
        self._local.busy = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._local.busy = False
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _HookLoader(spec.loader, self._callback)
        return spec


def when_imported(module_name: str, patch_module: Callable[[types.ModuleType], Undo]) -> Undo:
    """Run ``patch_module(module)`` on ``module_name`` now if it is imported, else right after it is imported.

    This lets a patch of a Megatron module be applied before ``megatron.core`` is imported (``apply_for`` runs
    first thing). The undo removes the hook if it has not fired, and undoes what ``patch_module`` did if it has.
    """
    state: dict[str, Any] = {}

    def fire(module: types.ModuleType) -> None:
        hook = state.pop("hook", None)
        if hook is not None and hook in sys.meta_path:
            sys.meta_path.remove(hook)
        if "undo" not in state:
            state["undo"] = patch_module(module)

    mod = sys.modules.get(module_name)
    if mod is not None:
        fire(mod)
    else:
        hook = _ImportHook(module_name, fire)
        state["hook"] = hook
        sys.meta_path.insert(0, hook)

    def undo() -> None:
        hook = state.pop("hook", None)
        if hook is not None and hook in sys.meta_path:
            sys.meta_path.remove(hook)
        inner = state.pop("undo", None)
        if inner is not None:
            inner()

    return undo


def when_imported_checked(patch: str, module_name: str, patch_module: Callable[[types.ModuleType], Undo]) -> Undo:
    """:func:`when_imported`, but the loaded module is first checked against ``patch``'s fingerprints (its targets
    in that module, read from the file it was loaded from): if one is not the code the patch was written for,
    ``patch_module`` is not run and the patch is undone (:func:`skipped`)."""

    def checked(module: types.ModuleType) -> Undo:
        from . import _registry, _targets
        from ._fingerprints import FINGERPRINTS

        try:
            from ..detect import detect

            version: Any = detect().version
        except Exception:  # the message names the file anyway
            version = "(version unknown)"
        why = _targets.loaded_refusal(patch, _registry.get(patch).targets, module, version,
                                      FINGERPRINTS.get(patch, {}))
        if why:
            return skipped(patch, why)
        return patch_module(module)

    return when_imported(module_name, checked)


def skipped(patch: str, why: str) -> Undo:
    """``patch`` found its target changed when the module was imported: warn, undo the whole patch and list it as
    skipped, not applied (``patches.skipped()``). Returns a no-op undo for the module part, which changed nothing."""
    from . import _registry

    warnings.warn(f"mcore-compat patch {patch!r} was not applied: {why}", RuntimeWarning, stacklevel=3)
    _registry.target_changed(patch, why)
    return lambda: None
