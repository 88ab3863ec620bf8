"""Facts about Megatron-Core as data: look up the value a named fact has for the installed release.

The rows are in :mod:`mcore_compat._facts.table` (one :class:`~mcore_compat._facts.rows.Fact` per fact, each with a
probe of the real code). The adapters read them here instead of comparing versions::

    fact("ddp_ctor")                  # "ddpcfg_pgc" on 0.15+
    has("core_optimizer")             # a boolean fact (capability): False on 0.4/0.5

The 33 capability names removed when the fact table was unified (2026-12-01: ``has("ddp_config")``,
``has("finalize_num_tokens")``, ...) still answer through :func:`has` and :func:`capability`, with the value they
always had, and warn once (:class:`DeprecationWarning`) naming the replacement (:mod:`mcore_compat._util.deprecated`).

``tests/test_surface_real.py`` asserts in every matrix session that each fact's value for the installed release
equals what its probe finds (:func:`drift`), so a row the code relies on cannot silently be wrong. Lookups are
cached per ``(name, version)``: facts are read on every training step.
"""

from __future__ import annotations

from typing import Any

from packaging.version import Version

from ._facts.ranges import parse_version
from ._facts.rows import Fact, flag
from ._facts.table import FACTS
from ._util.deprecated import DEPRECATED_FLAGS, warn_deprecated, warn_deprecated_name
from .detect import detect
from .errors import InvalidTypeError, UnknownFactError

__all__ = ["capabilities", "capability", "drift", "fact", "fact_row", "facts", "has", "resolved"]

#: ``(name, version) -> (row, value)``; the row is kept so that a replaced table entry (tests) is not served stale.
_CACHE: dict[tuple[str, Version], tuple[Fact[Any], Any]] = {}


def facts() -> tuple[Fact[Any], ...]:
    """Every fact of the table, in table order."""
    return tuple(FACTS.values())


def fact_row(name: str) -> Fact[Any]:
    """The table entry called ``name``.

    Raises:
        UnknownFactError: (a ``KeyError``) with the list of known names.
    """
    try:
        return FACTS[name]
    except KeyError:
        raise UnknownFactError(f"unknown fact {name!r}; known: {', '.join(FACTS)}") from None


def _version(version: Version | str | None) -> Version:
    return detect().version if version is None else parse_version(version)


def fact(name: str, version: Version | str | None = None) -> Any:
    """The value of fact ``name`` for ``version`` (default: the detected megatron-core).

    Raises:
        UnknownFactError: no fact is called ``name``.
        UnsupportedVersionError: no row covers ``version`` (older than 0.4).
    """
    ver = _version(version)
    entry = fact_row(name)
    hit = _CACHE.get((name, ver))
    if hit is not None and hit[0] is entry:
        return hit[1]
    value = entry.value_for(ver)
    _CACHE[(name, ver)] = (entry, value)
    return value


def has(name: str, version: Version | str | None = None) -> bool:
    """Whether the boolean fact (capability) ``name`` holds for ``version`` (default: the detected one).

    A capability name removed on 2026-12-01 answers as it did, from the fact that replaced it, and warns once
    (:class:`DeprecationWarning`) naming the replacement.

    Raises:
        UnknownFactError: no fact is called ``name``.
        InvalidTypeError: ``name`` is a valued fact (read it with :func:`fact`).
    """
    if name not in FACTS and name in DEPRECATED_FLAGS:
        alias = DEPRECATED_FLAGS[name]
        _warn_alias(name, f"has({name!r})", alias.replacement)
        return alias.value(fact(alias.fact, version))
    value = fact(name, version)
    if not isinstance(value, bool):
        raise InvalidTypeError(
            f"fact {name!r} is not a flag (its value for {version or 'this release'} is {value!r}); "
            f"read it with fact({name!r})"
        )
    return value


def capabilities() -> tuple[Fact[bool], ...]:
    """The boolean facts (capabilities) of the table."""
    return tuple(f for f in FACTS.values() if f.is_flag)


def capability(name: str) -> Fact[bool]:
    """The boolean fact called ``name``.

    A capability name removed on 2026-12-01 gives its old row (the range where it held, its value now derived
    from the fact that replaced it) and warns once, naming the replacement.

    Raises:
        UnknownFactError: (a ``KeyError``) no flag is called ``name``; the message lists the known ones.
    """
    if name not in FACTS and name in DEPRECATED_FLAGS:
        alias = DEPRECATED_FLAGS[name]
        _warn_alias(name, f"capability({name!r})", alias.replacement)
        source = FACTS[alias.fact]
        return flag(name, alias.was, f"deprecated since {alias.since}: {alias.replacement}",
                    lambda: alias.value(source.probe()), source.files())
    entry = FACTS.get(name)
    if entry is None or not entry.is_flag:
        raise UnknownFactError(f"unknown capability {name!r}; known: {', '.join(c.name for c in capabilities())}")
    return entry


def resolved(version: Version | str | None = None) -> dict[str, Any]:
    """``{name: value}`` for every fact, for ``version`` (default: the detected one)."""
    ver = _version(version)
    return {name: entry.value_for(ver) for name, entry in FACTS.items()}


def drift(version: Version | str | None = None) -> list[str]:
    """Run every fact's probe against the installed megatron-core and compare with the table.

    Args:
        version: the release the table is read for (default: the detected one; it must be the installed code).

    Returns:
        One message per fact whose probe disagrees with its row (or fails), each naming the fact; empty when the
        table matches the code.
    """
    ver = _version(version)
    return [msg for entry in FACTS.values() if (msg := entry.drift(ver)) is not None]


def _warn_alias(name: str, call: str, replacement: str) -> None:
    warn_deprecated(name, f"{call}: the capability {name!r} is deprecated since {DEPRECATED_FLAGS[name].since} "
                          f"(the fact table); use {replacement}", stacklevel=4)


def __getattr__(name: str) -> Any:
    """``Capability`` (the row class of the capability table until 2026-12-01) is the :class:`Fact` that
    :func:`capability` returns; deprecated, it warns once."""
    if name == "Capability":
        warn_deprecated_name(f"{__name__}.Capability")
        return Fact
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
