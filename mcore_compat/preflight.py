"""Can this environment run mcore-compat? Decided in the calling process, before any rank starts or Megatron is
imported.

:func:`preflight` finds megatron-core and its version (:func:`~mcore_compat.detect.detect`, nothing imported), looks
the version up in the support matrix (``matrix/versions.toml``) and checks the environment against that release's
limits (Python, torch, numpy, setuptools: :func:`mcore_compat.support.fit`). The result names every problem in one
message and gives the one command that repairs it. ``mcore-compat doctor`` prints it and exits non-zero when it is
not ``ok``; the self-check (:func:`mcore_compat.selfcheck.run`, ``mcore-compat self-check``) calls :func:`require`
and stops with one message instead of starting ranks that would all fail the same way.

Example::

    >>> from mcore_compat.preflight import preflight
    >>> result = preflight()
    >>> result.ok or print(result.message())  # doctest: +SKIP
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import InvalidArgumentError, McoreCompatError, MegatronNotFoundError

if TYPE_CHECKING:  # pragma: no cover
    from .detect import MegatronInfo
    from .support import Fit, Release, SupportStatus

__all__ = ["Preflight", "UnusableEnvironmentError", "install_command", "preflight", "require"]

#: The support levels of :class:`~mcore_compat.support.SupportStatus` that are tested releases.
_TESTED = ("listed", "local-build")


class UnusableEnvironmentError(McoreCompatError):
    """The environment cannot run mcore-compat (see :func:`require`); ``preflight`` holds the details and the fix.

    Attributes:
        preflight: the :class:`Preflight` that failed.
    """

    def __init__(self, result: Preflight) -> None:
        super().__init__(result.message())
        self.preflight = result


@dataclass(frozen=True)
class Preflight:
    """What :func:`preflight` found.

    Attributes:
        info: the detected megatron-core (``None``: not found, or its version cannot be told).
        found_at: the directory ``megatron.core`` resolves to, when it was found (even without a version).
        status: where the version stands in the support matrix (``None`` without a version).
        fit: the environment against the limits of the release that applies (``None`` when none applies).
        problems: what makes the environment unusable (empty: usable).
        notes: what is worth knowing but does not stop anything (an untested release that was allowed).
        fix: one shell command that repairs the first problem (``None``: no single command does).
        version_unknown: megatron-core was found but its version cannot be told (or ``MCORE_COMPAT_VERSION`` is
            malformed); ``False`` when it was not found at all, or when it was found with its version.
    """

    info: MegatronInfo | None
    found_at: Path | None
    status: SupportStatus | None
    fit: Fit | None
    problems: tuple[str, ...]
    notes: tuple[str, ...] = ()
    fix: str | None = None
    version_unknown: bool = False

    def __post_init__(self) -> None:
        if self.found_at is not None and self.info is None:
            object.__setattr__(self, "version_unknown", True)

    @property
    def ok(self) -> bool:
        """Nothing stops mcore-compat here."""
        return not self.problems

    def message(self) -> str:
        """The problems (one per line), then ``fix: <command>``; ``""`` when there is none."""
        lines = list(self.problems)
        if self.fix:
            lines.append(f"fix: {self.fix}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable form (``mcore-compat doctor --json``, key ``verdict``)."""
        return {"ok": self.ok, "problems": list(self.problems), "notes": list(self.notes), "fix": self.fix}


def _releases() -> list[Release]:
    from . import support

    return support.releases()


def install_command(python: str | None = None) -> str:
    """``<python> -m pip install megatron-core==<V>``: the newest listed release tested on the running Python."""
    from .support import newest_for_python, pip_command

    py = python or platform.python_version()
    release = newest_for_python(_releases(), py)
    return pip_command(f"megatron-core=={release.version}" if release else "megatron-core")


def _applicable_release(status: SupportStatus) -> Release | None:
    """The listed release whose limits apply: the version itself, its public release, else the nearest older."""
    return status.release or status.same_public or status.nearest_older


def preflight(*, allow_untested: bool = False, strict: bool = True) -> Preflight:
    """Check the installed megatron-core and the environment around it; imports neither megatron nor torch.

    Args:
        allow_untested: accept a release the matrix does not list (newer than the newest, or between listed
            releases): it becomes a note instead of a problem. An older release is never accepted.
        strict: every broken limit of the release is a problem (``doctor``); ``False``: only those known to stop
            it (:attr:`mcore_compat.support.Misfit.blocking`), the others become notes (the self-check, which then
            shows whether the release runs).

    Returns:
        The :class:`Preflight`; ``result.ok`` says whether anything stops mcore-compat.
    """
    from . import support
    from .detect import MegatronVersionUnknownError, detect

    try:
        info = detect()
    except MegatronVersionUnknownError as exc:
        return Preflight(None, exc.found_at, None, None, (str(exc),))
    except MegatronNotFoundError as exc:
        return Preflight(None, None, None, None, (str(exc),), fix=install_command())
    except InvalidArgumentError as exc:  # a malformed MCORE_COMPAT_VERSION
        return Preflight(None, None, None, None, (str(exc),), version_unknown=True)
    status = support.status(info.version)
    problems: list[str] = []
    notes: list[str] = []
    fix: str | None = None
    if status.level == "older":
        problems.append(f"megatron-core {status.summary()}: mcore-compat cannot run it.")
        fix = install_command()
    elif status.level not in _TESTED:
        if allow_untested:
            notes.append(f"megatron-core {status.summary()}.")
        else:
            problems.append(f"megatron-core {status.summary()}. Install a tested release, or accept this one "
                            f"explicitly (`mcore-compat doctor --allow-untested`).")
            fix = install_command()
    release = None if status.level == "older" else _applicable_release(status)
    fit = support.fit(release, releases=_releases()) if release is not None else None
    if fit is not None and not fit.ok:
        if strict or any(m.blocking for m in fit.misfits):
            problems.insert(0, f"the environment {fit.summary()}.")
            fix = fit.fix
        else:
            notes.append(f"the environment {fit.summary()} (fix: {fit.fix}).")
    return Preflight(info, info.path, status, fit, tuple(problems), tuple(notes), fix)


def require(*, allow_untested: bool = True, strict: bool = False) -> Preflight:
    """:func:`preflight`, raising when the environment is unusable.

    Args:
        allow_untested: see :func:`preflight` (default ``True``: running on an untested release is how it gets
            tested; the note says so).
        strict: see :func:`preflight` (default ``False``: a limit the release is known to run without is a note).

    Returns:
        The :class:`Preflight` (``ok``), with any notes.

    Raises:
        UnusableEnvironmentError: megatron-core is missing, its version cannot be told, the release is older than
            every supported one, or the environment breaks the release's limits.
    """
    result = preflight(allow_untested=allow_untested, strict=strict)
    if not result.ok:
        raise UnusableEnvironmentError(result)
    return result
