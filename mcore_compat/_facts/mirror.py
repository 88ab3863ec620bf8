"""The mirror of Megatron-Core's module layout: ``mcore_compat.core.<path>`` stands for ``megatron.core.<path>``.

``from megatron.core.optimizer import OptimizerConfig`` becomes ``from mcore_compat.core.optimizer import
OptimizerConfig`` and imports on every release that has the name at that path or where it moved
(:func:`mcore_compat.surface.locate`). Lazy, like ``six.moves``: importing a mirror module imports nothing of
Megatron; the first use of a name imports Megatron's module that has it and returns Megatron's own object.

* :class:`MirrorFinder` (on ``sys.meta_path``) makes ``import mcore_compat.core.a.b`` work for every module path
  of the data (:mod:`mcore_compat._facts.surface_data`); :class:`MirrorModule` is what it creates.
* A name is resolved, on each use (nothing is copied, so a later assignment in Megatron's module is seen), as:
  a submodule of the data -> the mirror's submodule; else the name of Megatron's module at the same path in the
  installed release; else the name where :func:`~mcore_compat.surface.locate` finds it; else, in a ``from ...
  import``, :class:`~mcore_compat.errors.NameUnavailableError` (an ``ImportError``) naming the releases that have
  it, and in an attribute read (``mpu.x``, ``hasattr(mpu, "x")``)
  :class:`~mcore_compat.errors.SymbolUnavailableError` (an ``AttributeError``), as the raw module answers.
* Assignments to a mirror module's names (``mock.patch("mcore_compat.core.parallel_state.get_x")``) go to
  Megatron's module that the name is read from (where it moved, on a release that reaches the path by a move).

A mirror module for a path the installed release does not have imports only when a name whose definition moved to
or from it (a package: from it or a module below it) is reachable there; otherwise the import raises
:class:`~mcore_compat.errors.NameUnavailableError` naming the releases that have the module, as the raw import
raises ``ModuleNotFoundError``.
"""

from __future__ import annotations

import dis
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any

from .. import surface
from ..errors import NameUnavailableError, SymbolUnavailableError

#: The mirror's root package and the package it stands for.
ROOT = "mcore_compat.core"
MEGATRON = "megatron.core"

#: The opcode of ``from x import y``'s attribute lookup (told apart from ``x.y``, ``hasattr(x, "y")``).
_IMPORT_FROM = dis.opmap["IMPORT_FROM"]

#: ``(mirror module, name) -> Megatron's module`` that served the name (read live from there on later reads).
_ROUTES: dict[tuple[str, str], types.ModuleType] = {}

#: Dunder names forwarded to Megatron's module (the others are the mirror module's own).
_FORWARDED_DUNDERS = frozenset({"__all__", "__version__"})


def real_path(mirror_name: str) -> str:
    """``mcore_compat.core.a.b`` -> ``megatron.core.a.b``."""
    return MEGATRON + mirror_name[len(ROOT):]


def mirror_path(megatron_name: str) -> str:
    """``megatron.core.a.b`` -> ``mcore_compat.core.a.b``."""
    return ROOT + megatron_name[len(MEGATRON):]


def installed_release() -> str:
    """The installed megatron-core release, as the data looks it up (read without importing Megatron)."""
    from ..detect import detect

    return str(detect().version)


def _import_real(path: str) -> types.ModuleType | None:
    """Megatron's module ``path``, or ``None`` if the installed release has no such module (an import error
    inside the module itself, e.g. a missing apex, propagates as with a raw import)."""
    module = sys.modules.get(path)
    if module is not None:
        return module
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as exc:
        if exc.name and (path == exc.name or path.startswith(exc.name + ".")):
            return None
        raise


def _unavailable(module: str, name: str | None, release: str) -> dict[str, Any]:
    """The arguments of :class:`NameUnavailableError` for ``name`` of ``module`` (the module itself when ``name``
    is ``None``) missing on ``release``."""
    if name is None:
        found = surface.releases_having_module(module)
        what = f"module `{mirror_path(module)}` (`{module}`)"
    else:
        found = surface.releases_having(module, name)
        what = f"`{name}` from `{mirror_path(module)}` (`{module}.{name}`)"
    where = f"releases {surface.range_summary(found)} have it" if found else \
        "no supported release has it (mcore_compat/_facts/surface_data.py)"
    return {"message": f"cannot import {what}: megatron-core {release} has it neither at that path nor where it "
                       f"moved; {where}",
            "name": mirror_path(module), "symbol": name, "releases": tuple(found)}


def _is_submodule(module: str, name: str, release: str) -> bool:
    """Whether ``module.name`` is a module path of the data that the name is not bound over (a re-export of
    another object under the submodule's name wins, as at run time)."""
    if surface.module_ranges(f"{module}.{name}") == ():
        return False
    return surface.kind(module, name, release) in (None, "module")


class MirrorModule(types.ModuleType):
    """A module of the mirror: its names are those of Megatron's module at the same path, resolved on use."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            if name not in _FORWARDED_DUNDERS:
                raise AttributeError(name)
            real = _real_or_raise(self.__name__)
            if name == "__all__":  # `from mcore_compat.core.x import *`: what the star import of Megatron's gives
                return getattr(real, "__all__", [n for n in vars(real) if not n.startswith("_")])
            return getattr(real, name)
        route = _ROUTES.get((self.__name__, name))
        if route is not None and hasattr(route, name):
            return getattr(route, name)  # read live from Megatron's module each time: later changes are seen
        try:
            return resolve(self.__name__, name)
        except NameUnavailableError as exc:
            caller = sys._getframe(1)
            if caller.f_code.co_code[caller.f_lasti] == _IMPORT_FROM:
                raise
            raise SymbolUnavailableError(str(exc).replace("cannot import", "no attribute", 1)) from None

    def __setattr__(self, name: str, value: Any) -> None:
        if (name.startswith("__") and name.endswith("__")) or isinstance(value, MirrorModule):
            super().__setattr__(name, value)  # the import system's own attributes and our submodules
            return
        target = _owner(self.__name__, name)
        setattr(target, name, value)
        _ROUTES[(self.__name__, name)] = target  # later reads see the patched object

    def __delattr__(self, name: str) -> None:
        if name in self.__dict__:
            super().__delattr__(name)
            return
        delattr(_owner(self.__name__, name), name)

    def __dir__(self) -> list[str]:
        module = real_path(self.__name__)
        return sorted(set(super().__dir__()) | set(surface.names(module, installed_release())))

    def __repr__(self) -> str:
        return f"<mirror module {self.__name__!r} of {real_path(self.__name__)!r}>"


def _owner(mirror_name: str, name: str) -> types.ModuleType:
    """The Megatron module an assignment to ``<mirror module>.name`` goes to (``mock.patch``, a client's
    ``rope_utils.apply_rotary_pos_emb = patched``): the module the name is read from (where it moved, for a path
    the installed release reaches by a move), else Megatron's module at the same path (a new name)."""
    route = _ROUTES.get((mirror_name, name))
    if route is not None:
        return route
    try:
        resolve(mirror_name, name)
    except NameUnavailableError:
        pass
    route = _ROUTES.get((mirror_name, name))
    return route if route is not None else _real_or_raise(mirror_name)


def _real_or_raise(mirror_name: str) -> types.ModuleType:
    module = _import_real(real_path(mirror_name))
    if module is None:
        raise NameUnavailableError(**_unavailable(real_path(mirror_name), None, installed_release()))
    return module


def resolve(mirror_name: str, name: str) -> Any:
    """The object ``from <mirror_name> import <name>`` gives (see the module docstring for the order); the
    Megatron module it came from is remembered (:data:`_ROUTES`), so later reads go straight to it.

    Raises:
        NameUnavailableError: the installed release has the name neither at that path nor where it moved (an
            ``ImportError``, as the raw ``from ... import`` raises; :class:`MirrorModule` turns it into
            ``SymbolUnavailableError``, an ``AttributeError``, for an attribute read).
    """
    module = real_path(mirror_name)
    release = installed_release()
    if _is_submodule(module, name, release):
        return importlib.import_module(f"{mirror_name}.{name}")
    real = _import_real(module)
    if real is not None and hasattr(real, name):
        _ROUTES[(mirror_name, name)] = real
        return getattr(real, name)
    where = surface.locate(module, name, release)
    if where is not None and where.moved:
        target = _import_real(where.module)
        if target is not None and hasattr(target, name):
            _ROUTES[(mirror_name, name)] = target
            return getattr(target, name)
    raise NameUnavailableError(**_unavailable(module, name, release))


def _module_available(module: str, release: str) -> bool:
    """Whether the mirror module for ``module`` imports on ``release``: the release has the module, or a name
    whose definition moved to or from it (not a re-export it dropped); a package also when a module below it does
    (the path to a name that moved there: ``from mcore_compat.core.extensions.transformer_engine import TENorm``
    on 0.4-0.8)."""
    if _serves(module, release):
        return True
    if not surface.is_package(module):
        return False
    prefix = module + "."
    return any(_serves(m, release) for m in surface.modules() if m.startswith(prefix))


def _serves(module: str, release: str) -> bool:
    return surface.has_module(module, release) or \
        any(surface.locate(module, n, release) for n in surface.moved_names(module))


class MirrorLoader(importlib.abc.Loader):
    """Creates a :class:`MirrorModule`; executing it only checks that the installed release can serve it."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return MirrorModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        release = installed_release()
        path = real_path(module.__name__)
        if not _module_available(path, release):
            raise NameUnavailableError(**_unavailable(path, None, release))


class MirrorFinder(importlib.abc.MetaPathFinder):
    """Finds ``mcore_compat.core.<path>`` for every ``megatron.core.<path>`` module of the data."""

    loader = MirrorLoader()

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(ROOT + "."):
            return None
        module = real_path(fullname)
        if not surface.module_ranges(module):
            return None
        return importlib.machinery.ModuleSpec(fullname, self.loader, is_package=surface.is_package(module))


def install_root(module: types.ModuleType) -> None:
    """Make ``module`` (``mcore_compat.core``) the mirror of ``megatron.core`` and put the finder on
    ``sys.meta_path`` (once)."""
    module.__class__ = MirrorModule
    module.__path__ = []  # its submodules come from the finder, not from files
    if not any(isinstance(f, MirrorFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MirrorFinder())
