"""Integrity of the data tables (facts, symbols); needs no megatron-core.

Checks names, ranges and documentation of every row; that the rows of one fact cover every release from 0.4.0 up
exactly once (and a symbol's locations never overlap); that every range boundary is a release of the support
matrix (``matrix/versions.toml``); and that the drift check names a fact whose row disagrees with its probe.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Any

import pytest
from packaging.version import Version

from mcore_compat._facts.ranges import in_range, specifier
from mcore_compat._facts.rows import Fact, Row, Symbol, complement, flag
from mcore_compat._facts.symbol_table import SYMBOLS
from mcore_compat._facts.table import FACTS
from mcore_compat.capabilities import capabilities, capability, drift, fact, fact_row, has
from mcore_compat.errors import UnknownFactError, UnsupportedVersionError
from mcore_compat.support import releases

pytestmark = pytest.mark.unit

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ALLOWED_OPERATORS = {">=", "<", "=="}


def _matrix() -> list[Version]:
    """The releases of the support matrix (``matrix/versions.toml``)."""
    return sorted(r.version for r in releases())


def _bounds(spec: str) -> set[Version]:
    """The versions a range names (its boundaries)."""
    return {Version(s.version) for s in specifier(spec)}


def _check_range(spec: str) -> None:
    parsed = specifier(spec)
    assert len(parsed) > 0, f"empty range {spec!r}: write '>=0.4' for every release"
    for s in parsed:
        assert s.operator in _ALLOWED_OPERATORS, f"{spec!r}: use only >=, < and == (half-open ranges)"
        Version(s.version)  # no wildcards


# ------------------------------------------------------------------------------------------------- facts

_FACTS = list(FACTS.values())
_IDS = list(FACTS)


def test_fact_keys_match_names() -> None:
    for key, entry in FACTS.items():
        assert isinstance(entry, Fact) and key == entry.name


@pytest.mark.parametrize("entry", _FACTS, ids=_IDS)
def test_fact_row(entry: Fact[Any]) -> None:
    assert _IDENT.match(entry.name) and entry.name == entry.name.lower(), f"bad name {entry.name!r}"
    assert entry.rows and all(isinstance(r, Row) for r in entry.rows), f"{entry.name}: no rows"
    for row in entry.rows:
        _check_range(row.versions)
    assert entry.description.strip(), f"{entry.name}: empty description"
    assert callable(entry.probe), f"{entry.name}: probe is not callable"
    files = entry.files()
    assert files and all(f.startswith("megatron/") and f.endswith(".py") for f in files.split(", ")), (
        f"{entry.name}: names no Megatron file ({files!r})")
    assert entry.range()  # renders
    assert "/work/" not in entry.description and "api-drift" not in entry.description


@pytest.mark.parametrize("entry", _FACTS, ids=_IDS)
def test_fact_covers_every_release_once(entry: Fact[Any]) -> None:
    """From 0.4.0 up, every release (and every boundary) is covered by exactly one row; the newest row is open
    upwards. With half-open ranges an overlap or a gap always shows at a boundary, so this is exhaustive."""
    points = {Version("0.4.0"), Version("99.0")} | set(_matrix())
    for row in entry.rows:
        points |= _bounds(row.versions)
    for v in sorted(p for p in points if p >= Version("0.4.0")):
        hits = [r.versions for r in entry.rows if in_range(v, r.versions)]
        assert len(hits) == 1, f"{entry.name}: {v} is covered by {hits or 'no row'}"


@pytest.mark.parametrize("entry", _FACTS, ids=_IDS)
def test_fact_range_fits_matrix(entry: Fact[Any]) -> None:
    """Each row applies to some release of the matrix, and its boundaries are releases of the matrix."""
    matrix = _matrix()
    minors = {(v.major, v.minor) for v in matrix}
    for row in entry.rows:
        assert any(in_range(v, row.versions) for v in matrix), f"{entry.name}: {row.versions} matches no release"
        for bound in _bounds(row.versions):
            assert bound in matrix or ((bound.major, bound.minor) in minors and bound.micro == 0), (
                f"{entry.name}: boundary {bound} is not a release of the matrix")


@pytest.mark.parametrize("entry", _FACTS, ids=_IDS)
def test_fact_value_changes_at_every_boundary(entry: Fact[Any]) -> None:
    """Adjacent rows differ (two adjacent rows with one value would be one row)."""
    rows = sorted(entry.rows, key=lambda r: max((Version(s.version) for s in specifier(r.versions)
                                                 if s.operator == ">="), default=Version("0")))
    for a, b in itertools.pairwise(rows):
        assert a.value != b.value, f"{entry.name}: rows {a.versions!r} and {b.versions!r} have one value"


def test_optimizer_facts_are_none_exactly_without_core_optimizer() -> None:
    """The facts about megatron.core.optimizer say None where the package does not exist (0.4/0.5)."""
    for name in ("public_builder_params", "private_builder_params", "param_groups_style"):
        for v in _matrix():
            assert (fact(name, v) is None) == (not has("core_optimizer", v)), (name, v)


def test_flags_are_a_range_and_its_complement() -> None:
    assert complement(">=0.6,<0.10") == ("<0.6", ">=0.10")
    assert complement("<0.7") == (">=0.7",)
    f = flag("x", ">=0.17.1,<0.18", "d", lambda: True)
    assert [r.value for r in f.rows] == [True, False, False] and f.versions == ">=0.17.1,<0.18"
    with pytest.raises(ValueError, match="only >= and <"):
        complement("==0.5")


def test_fact_lookup() -> None:
    first = _FACTS[0]
    assert fact_row(first.name) is first
    assert capability("core_optimizer") is FACTS["core_optimizer"]
    assert all(c.is_flag for c in capabilities()) and len(capabilities()) < len(FACTS)
    with pytest.raises(KeyError, match="known"):
        capability("no_such_capability")
    with pytest.raises(UnknownFactError, match="known"):
        fact("no_such_fact", "0.16.1")
    with pytest.raises(KeyError, match="known"):
        capability("ddp_ctor")  # a valued fact is not a capability
    with pytest.raises(TypeError, match="fact\\('ddp_ctor'\\)"):
        has("ddp_ctor", "0.16.1")
    with pytest.raises(UnsupportedVersionError, match="ddp_ctor"):
        fact("ddp_ctor", "0.3.0")


def test_fact_values_of_known_releases() -> None:
    """A few rows the adapters depend on, read through the lookup (and its cache)."""
    assert [fact("ddp_ctor", v) for v in ("0.4.0", "0.6.0", "0.7.0", "0.12.3", "0.13.1", "0.19.2")] == [
        "kwargs_v4", "kwargs_v6", "ddpcfg_group", "ddpcfg", "ddpcfg_pgs", "ddpcfg_pgc"]
    assert fact("param_gather_owner", "0.8.0") == "optimizer" and fact("param_gather_owner", "0.9.0") == "ddp"
    assert has("zero_grad_buffer_arg", "0.5.0") and not has("zero_grad_buffer_arg", "0.6.0")
    assert "num_distributed_optimizer_instances" in fact("ddp_settings", "0.10.0")
    assert fact("get_fwd_bwd_params", "0.20.0") == ("pp_size", "vp_size", "schedule_pg_collection")  # open upwards


def test_fact_prerelease_is_its_release() -> None:
    """An rc of a minor is looked up as that release (0.15.0rc6 -> 0.15.0)."""
    assert fact("ddp_ctor", "0.15.0rc6") == "ddpcfg_pgc" and fact("ddp_ctor", "0.14.0") == "ddpcfg_pgs"
    patch_only = capability("buffer_nvfp4_unpacked_index_map")  # a 0.17.1-only API
    assert [patch_only.holds_for(v) for v in ("0.17.0", "0.17.1", "0.18.0")] == [False, True, False]
    assert patch_only.range() == "0.17.1 <= v < 0.18"


def test_drift_check_names_a_fact_whose_row_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong row is reported by the drift check, naming the fact; the lookup cache does not hide the change.

    The probes are replaced by ones that return the table's values of 0.16.1 (no megatron-core here);
    tests/test_surface_real.py does the same against the real probes of the installed release."""
    version = "0.16.1"
    for name, entry in FACTS.items():  # a table that agrees with its probes: no drift
        value = entry.value_for(version)
        monkeypatch.setitem(FACTS, name, dataclasses.replace(entry, probe=lambda value=value: value,
                                                             source=entry.files()))
    assert drift(version) == []
    assert fact("ddp_ctor", version) == "ddpcfg_pgc"
    right = FACTS["ddp_ctor"]
    wrong_rows = tuple(Row(r.versions, "kwargs_v4") if in_range(version, r.versions) else r for r in right.rows)
    monkeypatch.setitem(FACTS, "ddp_ctor", dataclasses.replace(right, rows=wrong_rows))
    report = drift(version)
    assert len(report) == 1 and "'ddp_ctor'" in report[0], report
    assert "'kwargs_v4'" in report[0] and "'ddpcfg_pgc'" in report[0] and "distributed_data_parallel.py" in report[0]
    assert fact("ddp_ctor", version) == "kwargs_v4"  # the cache follows the table


def test_a_failing_probe_is_drift() -> None:
    def broken() -> bool:
        raise ImportError("no apex")

    entry = flag("some_flag", ">=0.6", "d", broken)
    assert "some_flag" in (entry.drift("0.16.1") or "") and "ImportError: no apex" in (entry.drift("0.16.1") or "")


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
        assert loc.module.startswith(("megatron.", "mcore_compat._facts.fallbacks")), (
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
    """A fact name never shadows a symbol name (both are looked up by bare name in docs/doctor)."""
    clash = sorted(set(FACTS) & set(SYMBOLS))
    assert not clash, f"names used as both fact and symbol: {clash}"


def test_doctor_lists_every_fact() -> None:
    """``mcore-compat doctor --verbose`` shows every fact: flags as yes/no with their range, valued facts with their
    value."""
    from mcore_compat.cli import doctor

    rows = doctor._facts(Version("0.16.1"), probe=False)
    assert [r["name"] for r in rows] == list(FACTS)
    report = {"mcore_compat": "x", "python": {"version": "3", "executable": "python"}, "torch": {"present": False},
              "apex": {"present": False}, "transformer_engine": {"present": False},
              "megatron_core": {"found": True, "version": "0.16.1", "source": "test", "checkout": True, "path": "/x",
                                "warnings": []},
              "facts": rows, "symbols": [], "patches": []}
    lines = doctor.render(report, verbose=True).splitlines()
    assert any(ln.split()[:3] == ["=", "ddp_ctor", "'ddpcfg_pgc'"] for ln in lines), lines
    assert any(ln.split()[:3] == ["yes", "core_optimizer", "v"] for ln in lines), lines
    assert any(ln.split()[:2] == ["no", "zero_grad_buffer_arg"] for ln in lines), lines
