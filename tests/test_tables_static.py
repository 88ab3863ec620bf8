"""Integrity of the data tables (capabilities, symbols); needs no megatron-core.

Checks names, ranges and documentation of every row, that the locations of one symbol never overlap, and that
every range is meaningful for the support matrix (``matrix/versions.toml``).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from mcore_compat._capability_table import CAPABILITIES
from mcore_compat._ranges import in_range, specifier
from mcore_compat._symbol_table import SYMBOLS
from mcore_compat.capabilities import Capability, capability
from mcore_compat.symbols import Symbol

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

pytestmark = pytest.mark.unit

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ALLOWED_OPERATORS = {">=", "<", "=="}
_VERSIONS_TOML = Path(__file__).resolve().parents[1] / "matrix" / "versions.toml"


def _matrix() -> list[Version]:
    """The releases of the support matrix."""
    if not _VERSIONS_TOML.is_file():
        pytest.skip(f"{_VERSIONS_TOML} not found")
    data = tomllib.loads(_VERSIONS_TOML.read_text(encoding="utf-8"))
    return sorted(Version(r["version"]) for r in data["release"])


def _bounds(spec: str) -> set[Version]:
    """The versions a range names (its boundaries)."""
    return {Version(s.version) for s in specifier(spec)}


def _check_range(spec: str) -> None:
    parsed = specifier(spec)
    assert len(parsed) > 0, f"empty range {spec!r}: write '>=0.4' for every release"
    for s in parsed:
        assert s.operator in _ALLOWED_OPERATORS, f"{spec!r}: use only >=, < and == (half-open ranges)"
        Version(s.version)  # no wildcards


# ------------------------------------------------------------------------------------------- capabilities


def test_capability_names_unique() -> None:
    names = [c.name for c in CAPABILITIES]
    dups = sorted({n for n in names if names.count(n) > 1})
    assert not dups, f"duplicate capability names: {dups}"


@pytest.mark.parametrize("cap", CAPABILITIES, ids=[c.name for c in CAPABILITIES])
def test_capability_row(cap: Capability) -> None:
    assert isinstance(cap, Capability)
    assert _IDENT.match(cap.name) and cap.name == cap.name.lower(), f"bad name {cap.name!r}"
    _check_range(cap.versions)
    assert cap.description.strip(), f"{cap.name}: empty description"
    assert callable(cap.probe), f"{cap.name}: probe is not callable"
    assert cap.range()  # renders


@pytest.mark.parametrize("cap", CAPABILITIES, ids=[c.name for c in CAPABILITIES])
def test_capability_range_fits_matrix(cap: Capability) -> None:
    """Each row holds for some release of the matrix, and its boundaries are releases of the matrix."""
    matrix = _matrix()
    assert any(cap.holds_for(v) for v in matrix), f"{cap.name}: {cap.versions} holds for no supported release"
    minors = {(v.major, v.minor) for v in matrix}
    for bound in _bounds(cap.versions):
        assert bound in matrix or ((bound.major, bound.minor) in minors and bound.micro == 0), (
            f"{cap.name}: boundary {bound} is not a release of the matrix"
        )


def test_capability_lookup() -> None:
    first = CAPABILITIES[0]
    assert capability(first.name) is first
    with pytest.raises(KeyError, match="known"):
        capability("no_such_capability")


def test_capability_prerelease_is_its_release() -> None:
    """An rc of a minor is looked up as that release (0.15.0rc6 -> 0.15.0)."""
    cap = capability("ddp_pg_collection")
    assert cap.holds_for("0.15.0rc6") and not cap.holds_for("0.14.0")
    patch_only = capability("buffer_nvfp4_unpacked_index_map")  # a 0.17.1-only API
    assert [patch_only.holds_for(v) for v in ("0.17.0", "0.17.1", "0.18.0")] == [False, True, False]


# ------------------------------------------------------------------------------------------------ symbols


def test_symbol_keys_match_names() -> None:
    for key, sym in SYMBOLS.items():
        assert isinstance(sym, Symbol)
        assert key == sym.name


@pytest.mark.parametrize("sym", list(SYMBOLS.values()), ids=list(SYMBOLS))
def test_symbol_row(sym: Symbol) -> None:
    assert _IDENT.match(sym.name), f"bad name {sym.name!r}"
    assert sym.locations, f"{sym.name}: no locations"
    assert sym.doc.strip(), f"{sym.name}: empty doc"
    for loc in sym.locations:
        _check_range(loc.versions)
        assert loc.module.startswith(("megatron.", "mcore_compat._fallbacks")), (
            f"{sym.name}: {loc.module} is neither a megatron module nor one of our fallbacks")
        assert all(_IDENT.match(part) for part in loc.module.split(".")), f"{sym.name}: bad module {loc.module}"
        assert loc.attr is None or _IDENT.match(loc.attr), f"{sym.name}: bad attr {loc.attr!r}"


@pytest.mark.parametrize("sym", list(SYMBOLS.values()), ids=list(SYMBOLS))
def test_symbol_ranges_do_not_overlap(sym: Symbol) -> None:
    """At most one location per release. With half-open ranges an overlap always contains one of the
    boundaries, so checking every boundary (and every release of the matrix) is exhaustive."""
    points = set(_matrix())
    for loc in sym.locations:
        points |= _bounds(loc.versions)
    for v in sorted(points):
        hits = [loc.versions for loc in sym.locations if in_range(v, loc.versions)]
        assert len(hits) <= 1, f"{sym.name}: ranges {hits} overlap at {v}"


@pytest.mark.parametrize("sym", list(SYMBOLS.values()), ids=list(SYMBOLS))
def test_symbol_exists_somewhere_in_matrix(sym: Symbol) -> None:
    assert any(sym.location_for(v) is not None for v in _matrix()), f"{sym.name}: in no supported release"
    assert sym.available_in() != "no release"


def test_names_do_not_collide() -> None:
    """A capability name never shadows a symbol name (both are looked up by bare name in docs/doctor)."""
    clash = sorted({c.name for c in CAPABILITIES} & set(SYMBOLS))
    assert not clash, f"names used as both capability and symbol: {clash}"
