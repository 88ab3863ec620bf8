"""The support matrix read from one ``matrix/`` directory (:class:`Matrix`), and the module-level shortcuts."""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packaging.version import Version

from .errors import InvalidArgumentError, MatrixFileError, NotFoundError
from .files import README_FILE, RESULTS_FILE, VERSIONS_FILE, atomic_write, default_dir, writable_dir
from .model import RESULT_KINDS, Release, SupportStatus
from .parse import computed_tags, parse_release, python_key
from .render import render

if sys.version_info >= (3, 11):
    import tomllib as _toml
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as _toml

if TYPE_CHECKING:  # pragma: no cover
    from importlib.resources.abc import Traversable

__all__ = ["Matrix", "base_requirements", "record_result", "releases", "render_table", "results", "status"]

_RESULT_VALUES = ("pass", "fail")
_RESULTS_SCHEMA = 1
#: Written by scripts/checkpoint_matrix.py.
CHECKPOINT_CROSS_FILE = "checkpoint_cross.json"


class Matrix:
    """The support matrix read from one directory (``matrix/`` of the source tree or the installed package data).

    Args:
        data_dir: where ``versions.toml`` and ``results.json`` are read from (default: the installed package data,
            else the source tree).
        results_dir: where :meth:`record_result` and :meth:`write_readme` write (default: the source tree's
            ``matrix/``; the installed package data is never written).
    """

    def __init__(self, data_dir: Traversable | str | os.PathLike[str] | None = None,
                 results_dir: str | os.PathLike[str] | None = None) -> None:
        if data_dir is None:
            self._data: Traversable = default_dir()
        elif isinstance(data_dir, (str, os.PathLike)):
            self._data = Path(data_dir)
        else:
            self._data = data_dir
        self._results_dir = Path(results_dir) if results_dir is not None else None

    # -- reading
    def raw(self) -> dict[str, Any]:
        """The parsed ``versions.toml``."""
        return _toml.loads(self._data.joinpath(VERSIONS_FILE).read_text(encoding="utf-8"))

    def releases(self) -> list[Release]:
        """All listed releases, oldest first, with their computed tags.

        Raises:
            MatrixFileError: ``versions.toml`` is malformed.
        """
        raw = self.raw()
        bases = raw.get("base", {})
        parsed = sorted((parse_release(e, bases) for e in raw.get("release", [])), key=lambda r: r.version)
        seen = [r.version for r in parsed]
        if len(set(seen)) != len(seen):
            twice = sorted({str(v) for v in seen if seen.count(v) > 1})
            raise MatrixFileError(
                f"versions.toml lists a release twice: {', '.join(twice)} (keep one entry of each)"
            )
        return [Release(**{**vars(r), "tags": computed_tags(r, parsed)}) for r in parsed]

    def release(self, version: str | Version) -> Release | None:
        """The listed release equal to ``version``, or ``None``."""
        wanted = Version(str(version))
        return next((r for r in self.releases() if r.version == wanted), None)

    def pythons(self) -> list[str]:
        """The Python versions that have a base environment (``["3.11", "3.12"]``)."""
        return sorted(self.raw().get("base", {}), key=lambda p: tuple(int(x) for x in p.split(".")))

    def base_requirements(self, python: str) -> list[str]:
        """The requirements of the shared base environment of ``python`` (``"3.11"`` or ``"3.11.7"``).

        Raises:
            NotFoundError: ``versions.toml`` has no base environment for ``python``.
        """
        key = python_key(python)
        bases = self.raw().get("base", {})
        if key not in bases:
            raise NotFoundError(f"versions.toml has no [base.\"{key}\"] table (have: {sorted(bases)})")
        return [str(r) for r in bases[key].get("requirements", [])]

    def results(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Recorded results: ``{"0.16.1": {"cpu": {"result": "pass", "date": ..., ...}, "gpu": {...}}}``."""
        source = self._results_dir / RESULTS_FILE if self._results_dir else self._data.joinpath(RESULTS_FILE)
        if not source.is_file():
            return {}
        data = json.loads(source.read_text(encoding="utf-8"))
        return {str(k): dict(v) for k, v in data.get("results", {}).items()}

    def checkpoint_cross(self) -> dict[str, Any] | None:
        """The recorded checkpoint matrix (``checkpoint_cross.json``: saved on A, loaded on B), or ``None``."""
        source = self._data.joinpath(CHECKPOINT_CROSS_FILE)
        return json.loads(source.read_text(encoding="utf-8")) if source.is_file() else None

    def status(self, version: str | Version) -> SupportStatus:
        """Where ``version`` stands: listed or not, its minor's releases, the nearest listed releases."""
        wanted = Version(str(version))
        public = Version(wanted.public)
        listed = self.releases()
        minor = f"{wanted.major}.{wanted.minor}"
        exact = next((r for r in listed if r.version == wanted), None)
        same_public = next((r for r in listed if r.version == public), None) if exact is None else None
        older = [r for r in listed if r.version < public]
        newer = [r for r in listed if r.version > public]
        return SupportStatus(
            version=wanted,
            release=exact,
            same_public=same_public,
            minor=minor,
            minor_releases=tuple(r for r in listed if r.minor == minor),
            nearest_older=older[-1] if older else None,
            nearest_newer=newer[0] if newer else None,
            newer_than_newest=bool(listed) and public > listed[-1].version,
            older_than_oldest=bool(listed) and public < listed[0].version,
            results=self.results().get(str(exact.version), {}) if exact is not None else {},
        )

    # -- writing
    def record_result(self, version: str | Version, kind: str, result: Mapping[str, Any]) -> dict[str, Any]:
        """Record one result of a listed release into ``results.json`` of the source tree; returns the entry.

        Args:
            version: a listed release.
            kind: ``"cpu"`` or ``"gpu"``.
            result: at least ``{"result": "pass" | "fail"}``; usually also ``python``, ``torch``, pytest counts
                (``passed``, ``failed``, ``skipped``, ``errors``) or per-check results (``checks``) and ``details``.
                ``date`` defaults to today (UTC).

        Raises:
            InvalidArgumentError: ``version`` is not listed, or ``kind`` or ``result["result"]`` is not known.
        """
        release = self.release(version)
        if release is None:
            raise InvalidArgumentError(
                f"{version} is not a listed release; results are recorded only for listed "
                f"releases (add it to versions.toml first)"
            )
        if kind not in RESULT_KINDS:
            raise InvalidArgumentError(f"kind must be one of {RESULT_KINDS}, not {kind!r}")
        if result.get("result") not in _RESULT_VALUES:
            raise InvalidArgumentError(
                f"result['result'] must be one of {_RESULT_VALUES}, "
                f"not {result.get('result')!r}"
            )
        entry = {"date": _dt.datetime.now(_dt.timezone.utc).date().isoformat(), **dict(result)}
        json.dumps(entry)  # fail early on values that cannot be stored
        target = writable_dir(self._results_dir) / RESULTS_FILE
        data: dict[str, Any] = {"schema": _RESULTS_SCHEMA, "results": {}}
        if target.is_file():
            data = json.loads(target.read_text(encoding="utf-8"))
        per_version = data.setdefault("results", {})
        per_version.setdefault(str(release.version), {})[kind] = entry
        data["results"] = {k: per_version[k] for k in sorted(per_version, key=Version)}
        atomic_write(target, json.dumps(data, indent=2, sort_keys=False) + "\n")
        return entry

    def render_table(self) -> str:
        """``matrix/README.md``: the support table and the base environments."""
        return render(self.releases(), self.results(), {p: self.base_requirements(p) for p in self.pythons()},
                      checkpoint_cross=self.checkpoint_cross())

    def write_readme(self) -> Path:
        """Write :meth:`render_table` to the source tree's ``matrix/README.md``; returns the path."""
        target = writable_dir(self._results_dir) / README_FILE
        atomic_write(target, self.render_table())
        return target


def releases() -> list[Release]:
    """All supported releases, oldest first (see :class:`Release`)."""
    return Matrix().releases()


def base_requirements(python: str) -> list[str]:
    """Requirements of the shared base environment of ``python`` (``"3.11"``)."""
    return Matrix().base_requirements(python)


def status(version: str | Version) -> SupportStatus:
    """Where ``version`` stands against the supported releases (see :class:`SupportStatus`)."""
    return Matrix().status(version)


def results() -> dict[str, dict[str, dict[str, Any]]]:
    """Recorded results by release and kind (``{"0.16.1": {"cpu": {...}}}``)."""
    return Matrix().results()


def record_result(version: str | Version, kind: str, result: Mapping[str, Any],
                  path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Record a ``"cpu"``/``"gpu"`` result of a listed release into the source tree's ``matrix/results.json``.

    ``path`` is the ``matrix/`` directory to write (default: the source tree's). See :meth:`Matrix.record_result`.
    """
    target = writable_dir(path)
    return Matrix(target, results_dir=target).record_result(version, kind, result)


def render_table() -> str:
    """The generated ``matrix/README.md`` (support table, results, base environments)."""
    return Matrix().render_table()
