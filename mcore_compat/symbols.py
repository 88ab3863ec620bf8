"""The import surface: symbol -> version range -> module path/attribute, resolved lazily (like ``six.moves``).

The table itself is data (:data:`SYMBOLS`, in :mod:`mcore_compat._facts.symbol_table`; rows :class:`Symbol` /
:class:`Location` from :mod:`mcore_compat._facts.rows`). ``mcore_compat.<name>``
resolves a row on first access against the installed Megatron-Core. A symbol that the installed release does not
have resolves to an :class:`Unavailable` placeholder: it is falsy, and any use (call, attribute, instantiation)
raises :class:`~mcore_compat.errors.SymbolUnavailableError` naming the symbol, the installed version and the
versions that have it.
"""

from __future__ import annotations

import importlib
from typing import Any, NoReturn

from packaging.version import Version

from ._facts.rows import Location, Symbol
from ._facts.symbol_table import SYMBOLS
from .detect import detect
from .errors import SymbolUnavailableError

__all__ = ["Location", "Symbol", "Unavailable", "resolve", "resolve_location", "symbol_names"]


class Unavailable:
    """Placeholder for a symbol the installed Megatron-Core does not have. Any use raises."""

    __slots__ = ("_message", "_name")

    def __init__(self, name: str, message: str) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_message", message)

    def _raise(self, *_: Any, **__: Any) -> NoReturn:
        raise SymbolUnavailableError(object.__getattribute__(self, "_message"))

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        self._raise()

    __call__ = _raise
    __iter__ = _raise
    __getitem__ = _raise

    def __setattr__(self, key: str, value: Any) -> None:
        self._raise()

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<unavailable {object.__getattribute__(self, '_name')}: {object.__getattribute__(self, '_message')}>"


def symbol_names() -> list[str]:
    """Every name of the import surface."""
    return sorted(SYMBOLS)


def _symbol(name: str) -> Symbol:
    try:
        return SYMBOLS[name]
    except KeyError:
        raise SymbolUnavailableError(
            f"`{name}` is not part of mcore_compat's import surface; known names: {', '.join(symbol_names())}"
        ) from None


def resolve_location(name: str, version: Version) -> Location | None:
    """The table's location of ``name`` for ``version`` (no import).

    Raises:
        SymbolUnavailableError: ``name`` is not in the table.
    """
    return _symbol(name).location_for(version)


def resolve(name: str, version: Version | None = None) -> Any:
    """Import and return the object ``mcore_compat.<name>`` stands for in the installed release.

    Args:
        name: a name from :func:`symbol_names`.
        version: the release to resolve for (default: the detected one).

    Returns:
        The object, or an :class:`Unavailable` placeholder if the release does not have it.

    Raises:
        SymbolUnavailableError: ``name`` is not in the table, or the release should have it but importing it
            failed (the message names the module and the import error, e.g. a missing apex/TransformerEngine).
    """
    ver = version if version is not None else detect().version
    sym = _symbol(name)
    loc = sym.location_for(ver)
    if loc is None:
        return Unavailable(
            name,
            f"`{name}` is not available in the installed megatron-core {ver}; it exists in "
            f"{sym.available_in()}. Install such a release, or guard the use with `if mcore_compat.{name}:`.",
        )
    try:
        module = importlib.import_module(loc.module)
        return getattr(module, loc.attr) if loc.attr else module
    except (ImportError, AttributeError) as exc:
        hint = f" It needs {sym.needs}." if sym.needs else ""
        raise SymbolUnavailableError(
            f"`{name}` should come from `{loc.dotted()}` in megatron-core {ver}, but importing it failed: "
            f"{type(exc).__name__}: {exc}.{hint} `mcore-compat doctor` shows which patches apply (e.g. "
            f"`mcore_compat.patches.apply_for('apex_less')`)."
        ) from exc
