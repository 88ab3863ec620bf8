"""Reading ``matrix/versions.toml``: one release entry, and the tags computed over all of them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from .errors import InvalidArgumentError, MatrixFileError
from .model import INSTALL_KINDS, LIMIT_FIELDS, Release

__all__ = ["computed_tags", "parse_release", "python_key"]

_RELEASE_KEYS = frozenset({"version", "python", "requires_python", "torch", "numpy", "setuptools", "install",
                           "wheel_python", "notes", "tags"})


def python_key(python: str) -> str:
    """``"3.11.7"`` / ``"3.11"`` / ``"py311"`` -> ``"3.11"``.

    Raises:
        InvalidArgumentError: ``python`` is not a Python version.
    """
    text = python.removeprefix("py")
    if "." not in text and len(text) >= 2:
        text = f"{text[0]}.{text[1:]}"
    parts = text.split(".")
    if len(parts) < 2 or not all(p.isdigit() for p in parts[:2]):
        raise InvalidArgumentError(f"not a Python version: {python!r}")
    return f"{parts[0]}.{parts[1]}"


def _check_specifier(version: str, name: str, value: str) -> None:
    if value:
        try:
            SpecifierSet(value)
        except InvalidSpecifier as exc:
            raise MatrixFileError(
                f"versions.toml, release {version}: {name} = {value!r} is not a specifier"
            ) from exc


def parse_release(entry: Mapping[str, Any], bases: Mapping[str, Any]) -> Release:
    """One ``[[release]]`` table of ``versions.toml`` as a :class:`Release` (tags as written, not computed).

    Args:
        entry: the table.
        bases: the ``[base."3.11"]``-style tables (the release's python must have one).

    Raises:
        MatrixFileError: unknown keys, a bad version or specifier, a python without base, a bad install kind.
    """
    raw_version = str(entry.get("version", ""))
    unknown = set(entry) - _RELEASE_KEYS
    if unknown:
        raise MatrixFileError(f"versions.toml, release {raw_version}: unknown keys {sorted(unknown)}")
    try:
        version = Version(raw_version)
    except InvalidVersion as exc:
        raise MatrixFileError(f"versions.toml: bad release version {raw_version!r}") from exc
    try:
        python = python_key(str(entry.get("python", "")))
    except InvalidArgumentError as exc:
        raise MatrixFileError(f"versions.toml, release {version}: {exc}") from exc
    if python not in bases:
        raise MatrixFileError(
            f"versions.toml, release {version}: no [base.\"{python}\"] table for python {python}"
        )
    install = str(entry.get("install", "wheel"))
    if install not in INSTALL_KINDS:
        raise MatrixFileError(f"versions.toml, release {version}: install must be one of {INSTALL_KINDS}")
    wheel_python = str(entry.get("wheel_python", ""))
    if install == "unpack-wheel" and not wheel_python:
        raise MatrixFileError(
            f"versions.toml, release {version}: install = 'unpack-wheel' needs wheel_python"
        )
    for name in LIMIT_FIELDS:
        _check_specifier(raw_version, name, str(entry.get(name, "")))
    return Release(version=version, python=python, install=install, wheel_python=wheel_python,
                   notes=str(entry.get("notes", "")), tags=tuple(str(t) for t in entry.get("tags", ())),
                   **{name: str(entry.get(name, "")) for name in LIMIT_FIELDS})


def computed_tags(release: Release, all_releases: list[Release]) -> tuple[str, ...]:
    """The tags of ``release`` (``cpu``, ``py3xx``, ``min``/``latest``, ``oldest``/``newest``) and its own ones.

    Args:
        release: one release.
        all_releases: every listed release, oldest first.
    """
    same_minor = [r.version for r in all_releases if r.minor == release.minor]
    tags = ["cpu", "py" + release.python.replace(".", "")]
    if release.version == min(same_minor):
        tags.append("min")
    if release.version == max(same_minor):
        tags.append("latest")
    if release.version == all_releases[0].version:
        tags.append("oldest")
    if release.version == all_releases[-1].version:
        tags.append("newest")
    return tuple(dict.fromkeys([*tags, *release.tags]))
