"""Version ranges used by every table in mcore-compat (capabilities, symbols, patches).

A range is a PEP 440 specifier string such as ``">=0.6,<0.10"``. Versions are compared as
:class:`packaging.version.Version` objects, never as strings.

Pre-releases, dev releases and local builds are placed at their *release*: ``0.15.0rc6``, ``0.20.0.dev0`` and
``0.20.0+abc123`` are looked up in the tables as ``0.15.0`` and ``0.20.0``. A release candidate of a minor ships
that minor's API (this is how Megatron-LM's own ``core_r0.X`` branches are versioned), so this is what users of
rc builds and source checkouts expect.
"""

from __future__ import annotations

from functools import cache

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from ..errors import InvalidArgumentError

__all__ = ["feature_version", "in_range", "parse_version", "range_text", "specifier"]


def parse_version(value: str | Version) -> Version:
    """Parse ``value`` as a PEP 440 version, with an error that says what was wrong."""
    if isinstance(value, Version):
        return value
    try:
        return Version(str(value).strip())
    except InvalidVersion as exc:
        raise InvalidArgumentError(
            f"{value!r} is not a valid PEP 440 version (expected something like '0.16.1', '0.20.0rc1', "
            f"'0.20.0+abc123')"
        ) from exc


def feature_version(version: str | Version) -> Version:
    """The release a version is looked up as: pre/dev/post/local parts dropped (``0.15.0rc6`` -> ``0.15.0``)."""
    return Version(parse_version(version).base_version)


@cache
def specifier(spec: str) -> SpecifierSet:
    """Parse a range string such as ``">=0.6,<0.10"`` (cached)."""
    try:
        return SpecifierSet(spec)
    except InvalidSpecifier as exc:
        raise InvalidArgumentError(
            f"{spec!r} is not a valid version range (expected e.g. '>=0.6,<0.10')"
        ) from exc


def in_range(version: str | Version, spec: str) -> bool:
    """Whether ``version`` (looked up by :func:`feature_version`) lies in the range ``spec``."""
    return specifier(spec).contains(feature_version(version), prereleases=True)


def range_text(spec: str) -> str:
    """A human-readable form of a range: ``">=0.6,<0.10"`` -> ``"0.6 <= v < 0.10"``."""
    parts = sorted(specifier(spec), key=lambda s: s.operator != ">=" and s.operator != ">")
    if not parts:
        return "every version"
    lo = [p for p in parts if p.operator in (">=", ">")]
    hi = [p for p in parts if p.operator in ("<", "<=")]
    if len(lo) == 1 and len(hi) == 1 and len(parts) == 2:
        return f"{lo[0].version} {'<=' if lo[0].operator == '>=' else '<'} v {hi[0].operator} {hi[0].version}"
    return " and ".join(f"v {p.operator} {p.version}" for p in parts)
