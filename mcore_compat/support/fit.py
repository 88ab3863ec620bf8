"""Does this environment fit a release's limits (``matrix/versions.toml``), and which pip command makes it fit?

``mcore-compat doctor`` and the self-check's pre-flight read the limits of the installed release (Python, torch,
numpy, setuptools) from the support matrix, compare them with the installed distributions' metadata (nothing is
imported) and print the exact command that repairs the environment, e.g. for megatron-core 0.8.0 next to
setuptools 84::

    /path/to/.venv/bin/python -m pip install 'setuptools<81'

A Python outside the release's ``requires_python`` cannot be repaired by pip: the fix then names the newest listed
release for the running Python, or a new virtual environment on a Python the release accepts.
"""

from __future__ import annotations

import importlib.metadata as md
import platform
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .model import Release

__all__ = ["LIMITED_DISTRIBUTIONS", "Fit", "Misfit", "fit", "installed_versions", "newest_for_python",
           "pip_command"]

#: The distributions whose installed versions the limits of a release speak about.
LIMITED_DISTRIBUTIONS = ("torch", "numpy", "setuptools")

#: Why a limit exists, said next to the problem (the limits themselves are in ``versions.toml``).
_WHY = {
    "setuptools": "the release imports pkg_resources, which setuptools 81 and later no longer ship",
    "numpy": "the release declares it",
    "torch": "the release declares or needs it",
    "python": "the release declares it",
}

#: Limits whose breach is not known to stop a run: ``numpy<2`` is declared by 0.13-0.15 (their metadata), and pip
#: enforces it on install, but the self-check passes on those releases next to numpy 2 (their GPU runs).
_ADVISORY = frozenset({"numpy"})


@dataclass(frozen=True)
class Misfit:
    """One limit of a release that the environment breaks.

    Attributes:
        name: ``"python"``, ``"torch"``, ``"numpy"`` or ``"setuptools"``.
        spec: the limit, a PEP 440 specifier (``"<81"``).
        installed: the installed version (``None``: not installed).
    """

    name: str
    spec: str
    installed: str | None

    @property
    def blocking(self) -> bool:
        """Known to stop the release (a missing ``pkg_resources``, a Python or torch it refuses); ``False`` for a
        declared limit the release is known to run without (numpy)."""
        return self.name not in _ADVISORY

    def message(self) -> str:
        """``setuptools<81 is required (...), but setuptools 84.2.1 is installed``."""
        have = f"{self.name} {self.installed} is installed" if self.installed else f"{self.name} is not installed"
        why = _WHY.get(self.name, "a limit of the release") if self.spec else "mcore-compat and Megatron-Core import it"
        return f"{self.name}{self.spec} is required ({why}), but {have}"


@dataclass(frozen=True)
class Fit:
    """How an environment stands against one release's limits (see :func:`fit`).

    Attributes:
        release: the release whose limits were checked.
        python: the running interpreter's version.
        installed: the versions of :data:`LIMITED_DISTRIBUTIONS` found (``None``: not installed).
        misfits: the limits the environment breaks (empty: it fits).
        fix: the command that makes it fit (``None`` when it fits).
    """

    release: Release
    python: str
    installed: Mapping[str, str | None]
    misfits: tuple[Misfit, ...]
    fix: str | None

    @property
    def ok(self) -> bool:
        """The environment satisfies every limit of the release."""
        return not self.misfits

    def summary(self) -> str:
        """One line: ``fits the limits of 0.8.0 (python, setuptools<81)`` or what breaks them."""
        if self.ok:
            limits = ", ".join(_limit_text(k, v) for k, v in self.release.limits().items())
            return f"fits the limits of {self.release.version}" + (f" ({limits})" if limits else " (none)")
        return (f"does NOT fit megatron-core {self.release.version}: "
                + "; ".join(m.message() for m in self.misfits))

    def as_dict(self) -> dict[str, object]:
        """A JSON-serialisable form (``mcore-compat doctor --json``)."""
        return {"release": str(self.release.version), "ok": self.ok, "python": self.python,
                "installed": dict(self.installed), "limits": self.release.limits(),
                "misfits": [m.message() for m in self.misfits], "fix": self.fix}


def _limit_text(name: str, spec: str) -> str:
    return f"{'python' if name == 'requires_python' else name}{spec}"


def installed_versions(names: Iterable[str] = LIMITED_DISTRIBUTIONS) -> dict[str, str | None]:
    """The installed versions of ``names`` from their distribution metadata (``None``: not installed)."""
    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = None
    return found


def newest_for_python(releases: Sequence[Release], python: str) -> Release | None:
    """The newest of ``releases`` tested on ``python``'s minor (``"3.11.7"`` -> the newest 3.11 release), else the
    newest whose ``requires_python`` admits ``python``."""
    minor = ".".join(python.split(".")[:2])
    same = [r for r in releases if r.python == minor]
    if same:
        return max(same, key=lambda r: r.version)
    admitted = [r for r in releases if _contains(r.requires_python, python)]
    return max(admitted, key=lambda r: r.version) if admitted else None


def pip_command(*requirements: str, python: str | None = None) -> str:
    """``<python> -m pip install 'setuptools<81' ...`` for the running interpreter (or ``python``), quoted for a
    POSIX shell."""
    exe = python or sys.executable or "python3"
    return " ".join([shlex.quote(exe), "-m", "pip", "install", *(shlex.quote(r) for r in requirements)])


def _contains(spec: str, version: str | None) -> bool:
    if not spec:
        return True
    if version is None:
        return False
    try:
        return SpecifierSet(spec).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def fit(release: Release, *, releases: Sequence[Release] = (), python: str | None = None,
        installed: Mapping[str, str | None] | None = None, python_exe: str | None = None) -> Fit:
    """Check the environment against ``release``'s limits and say how to repair it.

    Args:
        release: the installed (or intended) release.
        releases: every listed release, to name one for the running Python when the Python itself does not fit.
        python: the interpreter's version (default: the running one).
        installed: versions of :data:`LIMITED_DISTRIBUTIONS` (default: read from the installed metadata).
        python_exe: the interpreter the pip command runs (default: ``sys.executable``).

    Returns:
        The :class:`Fit`; ``fit.fix`` is one shell command (or two alternatives joined by ``or``).
    """
    py = python or platform.python_version()
    have = dict(installed_versions() if installed is None else installed)
    misfits: list[Misfit] = []
    limits = release.limits()
    if not _contains(limits.get("requires_python", ""), py):
        misfits.append(Misfit("python", limits["requires_python"], py))
    for name in LIMITED_DISTRIBUTIONS:
        spec = limits.get(name, "")
        if name == "torch" and have.get("torch") is None:  # mcore-compat and every release need torch
            misfits.append(Misfit("torch", spec, None))
        elif spec and not _contains(spec, have.get(name)):
            misfits.append(Misfit(name, spec, have.get(name)))
    fix: str | None = None
    if misfits:
        pip_fixable = [m for m in misfits if m.name != "python"]
        if any(m.name == "python" for m in misfits):
            other = newest_for_python(releases, py)
            venv = f"a virtual environment on a Python {limits['requires_python']} with megatron-core=={release.version}"
            fix = (f"{pip_command(f'megatron-core=={other.version}', python=python_exe)}   (the newest release "
                   f"tested on Python {'.'.join(py.split('.')[:2])}), or {venv}") if other else venv
        else:
            fix = pip_command(*(f"{m.name}{m.spec}" if m.spec else m.name for m in pip_fixable), python=python_exe)
    return Fit(release=release, python=py, installed=have, misfits=tuple(misfits), fix=fix)
