"""The records of the support matrix: a listed :class:`Release` and a version's :class:`SupportStatus`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

__all__ = ["INSTALL_KINDS", "LIMIT_FIELDS", "RESULT_KINDS", "Release", "SupportStatus"]

#: How a release is put on ``sys.path`` in the matrix (see ``matrix/versions.toml``).
INSTALL_KINDS = ("wheel", "unpack-wheel")
#: The kinds of recorded results.
RESULT_KINDS = ("cpu", "gpu")
#: The fields of a :class:`Release` that limit its environment (python, torch, numpy, setuptools).
LIMIT_FIELDS = ("requires_python", "torch", "numpy", "setuptools")


@dataclass(frozen=True)
class Release:
    """One supported Megatron-Core release, as listed in ``matrix/versions.toml``.

    Attributes:
        version: the exact PyPI release.
        python: the interpreter (``"3.11"``) the matrix session runs it on.
        requires_python: what the release declares (``""``: nothing).
        torch: torch specifier the release needs (``""``: any torch we test).
        numpy: numpy limit (``""``: none).
        setuptools: setuptools limit (``"<81"``: the release imports ``pkg_resources``).
        install: ``"wheel"`` or ``"unpack-wheel"`` (unzip the ``wheel_python`` wheel's ``megatron/`` tree).
        wheel_python: the Python whose wheel is unpacked (``install == "unpack-wheel"`` only).
        notes: free text shown in the support table.
        tags: ``"min"``/``"latest"`` (earliest/latest listed patch of its minor), ``"oldest"``/``"newest"``
            (overall), ``"cpu"``, ``"py311"``/``"py312"`` and any extra tags from the TOML file.
    """

    version: Version
    python: str
    requires_python: str = ""
    torch: str = ""
    numpy: str = ""
    setuptools: str = ""
    install: str = "wheel"
    wheel_python: str = ""
    notes: str = ""
    tags: tuple[str, ...] = ()

    @property
    def minor(self) -> str:
        """``"0.16"`` for 0.16.1."""
        return f"{self.version.major}.{self.version.minor}"

    @property
    def session(self) -> str:
        """The nox session name, ``mcore-0.16.1``."""
        return f"mcore-{self.version}"

    def limits(self) -> dict[str, str]:
        """The non-empty limits: ``{"requires_python": ">=3.10", "numpy": "<2", ...}``."""
        return {name: getattr(self, name) for name in LIMIT_FIELDS if getattr(self, name)}

    def unmet_limits(self, python_version: str, installed: Mapping[str, str | None]) -> list[str]:
        """The limits that an environment breaks, as messages (empty: all satisfied).

        Args:
            python_version: the interpreter's full version (``"3.11.7"``).
            installed: distribution name (``"torch"``, ``"numpy"``, ``"setuptools"``) to installed version
                (``None``: not installed).
        """
        problems: list[str] = []
        for name, spec in self.limits().items():
            dist = "python" if name == "requires_python" else name
            have = python_version if dist == "python" else installed.get(dist)
            if have is None:
                problems.append(f"{dist}{spec} is required but {dist} is not installed")
            elif not SpecifierSet(spec).contains(Version(have), prereleases=True):
                problems.append(f"{dist}{spec} is required but {dist} {have} is installed")
        return problems


@dataclass(frozen=True)
class SupportStatus:
    """Where a Megatron-Core version stands against the support matrix (see :func:`status`).

    Attributes:
        version: the version asked about.
        release: the listed release equal to ``version`` (``None``: not listed).
        same_public: the listed release equal to ``version`` without its local part (``0.16.1+abc`` -> 0.16.1).
        minor: ``"0.16"``.
        minor_releases: the listed releases of that minor.
        nearest_older: the newest listed release older than ``version``.
        nearest_newer: the oldest listed release newer than ``version``.
        newer_than_newest: ``version`` is newer than every listed release.
        older_than_oldest: ``version`` is older than every listed release.
        results: the recorded results of ``release`` by kind (``"cpu"``, ``"gpu"``).
    """

    version: Version
    release: Release | None
    same_public: Release | None
    minor: str
    minor_releases: tuple[Release, ...]
    nearest_older: Release | None
    nearest_newer: Release | None
    newer_than_newest: bool
    older_than_oldest: bool
    results: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def listed(self) -> bool:
        """The exact version is a listed (tested) release."""
        return self.release is not None

    @property
    def level(self) -> str:
        """One word: ``listed``, ``local-build`` (of a listed release), ``minor-listed``, ``newer``, ``older``
        or ``minor-unlisted``."""
        if self.release is not None:
            return "listed"
        if self.same_public is not None:
            return "local-build"
        if self.newer_than_newest:
            return "newer"
        if self.older_than_oldest:
            return "older"
        return "minor-listed" if self.minor_releases else "minor-unlisted"

    def summary(self) -> str:
        """One human-readable sentence."""
        v = self.version
        if self.release is not None:
            return f"{v} is a supported release{_results_phrase(self.results)}"
        if self.same_public is not None:
            return (f"{v} is a local build of the supported release {self.same_public.version}; it is treated as "
                    f"{self.same_public.version}")
        if self.newer_than_newest:
            return (f"{v} is newer than the newest supported release ({_v(self.nearest_older)}); it may work "
                    f"but is untested")
        if self.older_than_oldest:
            return f"{v} is older than the oldest supported release ({_v(self.nearest_newer)}); it is unsupported"
        if self.minor_releases:
            listed = ", ".join(str(r.version) for r in self.minor_releases)
            return (f"{v} is not a tested release, but its minor {self.minor} is supported (tested: {listed}); "
                    f"nearest tested: {_v(self.nearest_older)} / {_v(self.nearest_newer)}")
        return (f"{v} is not a tested release and its minor {self.minor} is not listed; nearest tested: "
                f"{_v(self.nearest_older)} / {_v(self.nearest_newer)}")

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable form (used by ``mcore-compat doctor --json``)."""
        return {
            "version": str(self.version),
            "listed": self.listed,
            "level": self.level,
            "summary": self.summary(),
            "minor": self.minor,
            "minor_releases": [str(r.version) for r in self.minor_releases],
            "nearest_older": _v(self.nearest_older, None),
            "nearest_newer": _v(self.nearest_newer, None),
            "newer_than_newest": self.newer_than_newest,
            "older_than_oldest": self.older_than_oldest,
            "results": self.results,
        }


def _v(release: Release | None, default: str | None = "none") -> str | None:
    return str(release.version) if release is not None else default


def _results_phrase(results: Mapping[str, Mapping[str, Any]]) -> str:
    parts = [f"{kind.upper()} {r.get('result', '?')} on {r.get('date', '?')}" for kind, r in sorted(results.items())]
    return f" ({'; '.join(parts)})" if parts else " (no recorded results)"
