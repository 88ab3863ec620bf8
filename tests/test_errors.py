"""Every exception class mcore-compat defines derives from :class:`mcore_compat.McoreCompatError`, so that
``except McoreCompatError`` catches whatever the library raises on purpose."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

from mcore_compat.errors import McoreCompatError

pytestmark = pytest.mark.unit

#: Modules not imported by the walk: importing a ``__main__`` (``python -m mcore_compat``, ``python -m
#: mcore_compat.support``) runs its command line.
_NOT_IMPORTED = frozenset({"mcore_compat.__main__", "mcore_compat.support.__main__"})


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
