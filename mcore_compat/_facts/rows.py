"""Row formats of every version table in mcore-compat: one fact, rows of ``(version range -> value)``.

A :class:`Fact` is a named piece of knowledge about Megatron-Core whose value depends on the release, such as
how the ``DistributedDataParallel`` constructor takes its settings, or whether ``megatron.core.optimizer`` exists.
Its :class:`Row`\\ s map half-open PEP 440 ranges (``">=0.7,<0.8"``) to values, and together they cover every
release from 0.4.0 up, with no overlap: the last row is open upwards, so a release newer than the matrix inherits
the newest value until a probe says otherwise. Each fact names the Megatron file it is read from and carries a
probe that returns the value *observed* in the installed release; ``tests/test_surface_real.py`` asserts
``probe() == value_for(installed)`` for every fact in every matrix session.

A boolean fact (a *capability*) is written with :func:`flag`: the range where it holds, the complement filled in
as ``False`` rows. A :class:`Symbol` of the import surface is the same shape: its :class:`Location` rows map a
range to where the object lives.

This module is a leaf (it imports only :mod:`mcore_compat._facts.ranges` and :mod:`mcore_compat.errors`, both leaves),
so the tables import their row classes from here and the lookups import the tables, all at top level.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from packaging.version import Version

from ..errors import InvalidArgumentError, UnsupportedVersionError
from .ranges import in_range, range_text, specifier

__all__ = ["Fact", "Location", "Row", "Symbol", "complement", "flag", "select"]

V = TypeVar("V")


class _Ranged(Protocol):
    """Anything with a ``versions`` range (a :class:`Row` or a :class:`Location`)."""

    @property
    def versions(self) -> str: ...


R = TypeVar("R", bound=_Ranged)


def select(rows: Iterable[R], version: Version | str) -> R | None:
    """The first of ``rows`` whose range contains ``version`` (looked up as its release), or ``None``."""
    for row in rows:
        if in_range(version, row.versions):
            return row
    return None


@dataclass(frozen=True)
class Row(Generic[V]):
    """``value`` holds for the releases in ``versions`` (a half-open PEP 440 range such as ``">=0.6,<0.10"``)."""

    versions: str
    value: V

    def range(self) -> str:
        """Human-readable range (``"0.6 <= v < 0.10"``)."""
        return range_text(self.versions)


def _span(spec: str) -> tuple[Version | None, Version | None]:
    """``(lower bound, upper bound)`` of a half-open range (``None``: unbounded)."""
    lo = hi = None
    for s in specifier(spec):
        if s.operator == ">=":
            lo = Version(s.version)
        elif s.operator == "<":
            hi = Version(s.version)
    return lo, hi


def _module_file(module: str) -> str:
    return module.replace(".", "/") + ".py"


@dataclass(frozen=True)
class Fact(Generic[V]):
    """One named fact about Megatron-Core and its value per release range.

    Attributes:
        name: identifier the code reads it by (``fact(name)``, ``has(name)`` for flags).
        rows: ``(range -> value)`` rows; together they cover 0.4.0 and everything newer, without overlap.
        description: what it means and where it changed (shown by ``mcore-compat doctor``).
        probe: returns the value observed in the installed ``megatron.core`` (reads its source, or imports it
            where the module imports on every release). Used by the drift test and ``doctor --probe``; never used
            to decide behaviour at run time.
        source: the Megatron file(s) the fact is read from; empty means "the files the probe reads"
            (``probe.modules``, as paths).
    """

    name: str
    rows: tuple[Row[V], ...]
    description: str
    probe: Callable[[], V]
    source: str = ""

    def row_for(self, version: Version | str) -> Row[V] | None:
        """The row covering ``version``, or ``None``."""
        return select(self.rows, version)

    def value_for(self, version: Version | str) -> V:
        """The table's value for ``version``.

        Raises:
            UnsupportedVersionError: no row covers ``version`` (older than every row).
        """
        row = select(self.rows, version)
        if row is None:
            raise UnsupportedVersionError(
                f"fact {self.name!r}: megatron-core {version} is not covered by mcore_compat's tables "
                f"(rows: {'; '.join(r.range() for r in self.rows)})")
        return row.value

    @property
    def is_flag(self) -> bool:
        """Whether every value is a bool (a capability, read with ``has``)."""
        return all(isinstance(r.value, bool) for r in self.rows)

    def holds_for(self, version: Version | str) -> bool:
        """For a flag: whether it holds for ``version`` (``False`` where no row covers it)."""
        row = select(self.rows, version)
        return bool(row is not None and row.value is True)

    def where(self, predicate: Callable[[V], bool]) -> str:
        """Human-readable union of the ranges whose value satisfies ``predicate``, adjacent ranges merged
        (``"v >= 0.8"``; ``"no release"`` if none)."""
        spans = sorted((_span(r.versions) for r in self.rows if predicate(r.value)),
                       key=lambda s: s[0] or Version("0"))
        merged: list[list[Version | None]] = []
        for lo, hi in spans:
            if merged and merged[-1][1] is not None and merged[-1][1] == lo:
                merged[-1][1] = hi
            else:
                merged.append([lo, hi])
        return " or ".join(range_text(",".join(
            ([f">={lo}"] if lo else []) + ([f"<{hi}"] if hi else []))) for lo, hi in merged) or "no release"

    @property
    def versions(self) -> str:
        """For a flag: the range spec(s) where it holds (``" or "``-joined if several)."""
        return " or ".join(r.versions for r in self.rows if r.value is True)

    def range(self) -> str:
        """Human-readable: where a flag holds, or the ranges of a valued fact."""
        if self.is_flag:
            return self.where(lambda value: value is True)
        return "; ".join(f"{r.range()}: {r.value!r}" for r in self.rows)

    def files(self) -> str:
        """The Megatron file(s) the fact is read from."""
        if self.source:
            return self.source
        return ", ".join(_module_file(m) for m in getattr(self.probe, "modules", ()))

    def drift(self, version: Version | str) -> str | None:
        """Run the probe and compare with the table: ``None`` if they agree, else a message naming the fact.

        A probe that raises is reported as drift too (with the exception).
        """
        try:
            found: Any = self.probe()
        except Exception as exc:  # report, the caller decides
            return f"fact {self.name!r}: the probe failed on megatron-core {version}: {type(exc).__name__}: {exc}"
        row = select(self.rows, version)
        if row is None:
            return f"fact {self.name!r}: no row covers megatron-core {version}; the probe finds {found!r}"
        if found != row.value:
            return (f"fact {self.name!r}: the table says {row.value!r} for megatron-core {version} (row "
                    f"{row.versions!r}), but the probe finds {found!r} in {self.files() or 'the installed code'}. "
                    f"Fix the row in mcore_compat/_facts/table.py.")
        return None


def complement(spec: str) -> tuple[str, ...]:
    """The half-open ranges outside ``spec`` (which uses only ``>=`` and ``<``): ``">=0.6,<0.10"`` ->
    ``("<0.6", ">=0.10")``.

    Raises:
        InvalidArgumentError: ``spec`` uses another operator.
    """
    out = []
    for s in sorted(specifier(spec), key=lambda s: Version(s.version)):
        if s.operator == ">=":
            out.append(f"<{s.version}")
        elif s.operator == "<":
            out.append(f">={s.version}")
        else:
            raise InvalidArgumentError(f"{spec!r}: a flag's range uses only >= and <")
    return tuple(out)


def flag(name: str, versions: str, description: str, probe: Callable[[], bool], source: str = "") -> Fact[bool]:
    """A boolean fact that holds for ``versions`` and nowhere else (the complement rows are ``False``)."""
    rows = (Row(versions, True), *(Row(spec, False) for spec in complement(versions)))
    return Fact(name, rows, description, probe, source)


@dataclass(frozen=True)
class Location:
    """Where a symbol lives for a range of releases: a row ``versions -> (module, attr)``.

    Attributes:
        versions: PEP 440 range, e.g. ``">=0.6,<0.10"``.
        module: dotted module path.
        attr: attribute of ``module``; ``None`` means the module itself.
    """

    versions: str
    module: str
    attr: str | None = None

    @property
    def value(self) -> tuple[str, str | None]:
        """``(module, attr)``: the row's value."""
        return self.module, self.attr

    def dotted(self) -> str:
        """``module.attr`` (or ``module``)."""
        return f"{self.module}.{self.attr}" if self.attr else self.module


@dataclass(frozen=True)
class Symbol:
    """One name of the import surface: rows of where it lives (ranges must not overlap; absent elsewhere).

    Attributes:
        name: the name under ``mcore_compat``.
        locations: where it lives, per version range.
        doc: what it is.
        needs: what importing it needs beyond megatron-core in some releases (shown in errors), e.g.
            ``"transformer_engine (0.4-0.7)"``.
    """

    name: str
    locations: tuple[Location, ...]
    doc: str = ""
    needs: str = ""

    def location_for(self, version: Version | str) -> Location | None:
        """The location valid for ``version``, or ``None`` if the symbol is absent there."""
        return select(self.locations, version)

    def available_in(self) -> str:
        """Human-readable union of the ranges that have the symbol."""
        return " or ".join(range_text(loc.versions) for loc in self.locations) or "no release"
