"""Find the installed Megatron-Core and its version, without importing ``megatron.core``.

Sources, in the order they are trusted:

1. the module actually imported (``megatron.core.package_info`` read from the directory ``megatron.core`` resolves
   to, or ``megatron.core.__version__`` when it is already imported): this is what runs, so it wins;
2. distribution metadata (``megatron-core`` or another distribution that ships ``megatron/core``), used when it
   describes that same directory.

Metadata that disagrees with the imported module (a source checkout on ``PYTHONPATH`` shadowing a wheel, a
stale install) is reported once as a warning; the imported module is trusted. ``MCORE_COMPAT_VERSION=<version>``
names the version of a tree whose version cannot be read; one that disagrees with a readable version is an error
(:class:`~mcore_compat.errors.InvalidArgumentError` naming both), never a silent override. No
fake "0.0.0" is ever returned: if no version can be found an error says so
(:class:`MegatronVersionUnknownError`, which carries the path that was found).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.version import InvalidVersion, Version

from .errors import InvalidArgumentError, MegatronNotFoundError

if TYPE_CHECKING:  # pragma: no cover
    import importlib.metadata as md

# ``importlib.metadata`` (and the email/zipfile/... modules it pulls in) costs ~40 ms to import: it is imported
# inside the functions that read distribution metadata, not with ``import mcore_compat``.

__all__ = ["MegatronInfo", "MegatronVersionUnknownError", "detect", "refresh"]

#: Distribution names known to ship ``megatron/core`` (checked first; any other distribution that owns the
#: imported files is found among the ``*megatron*.dist-info`` next to the imported tree).
KNOWN_DISTRIBUTIONS = ("megatron-core", "megatron_core")

_INSTALL_HINT = (
    "Install a supported release, e.g. `pip install megatron-core==0.16.1` (Python 3.10/3.11) or "
    "`pip install megatron-core==0.19.2` (Python >= 3.12), or put a Megatron-LM checkout on PYTHONPATH. "
    "`mcore-compat doctor` lists the supported releases, and which one fits this Python."
)


class MegatronVersionUnknownError(MegatronNotFoundError):
    """``megatron.core`` was found, but its version cannot be told (no metadata, no readable ``package_info.py``).

    Attributes:
        found_at: the directory ``megatron.core`` would be imported from.
    """

    def __init__(self, message: str, found_at: Path) -> None:
        super().__init__(message)
        self.found_at = found_at


@dataclass(frozen=True)
class MegatronInfo:
    """What :func:`detect` found.

    Attributes:
        version: the version of the module that is (or will be) imported.
        source: where ``version`` came from: ``"metadata"`` (distribution metadata that describes the imported
            files), ``"package_info"`` (``megatron/core/package_info.py`` of the imported directory, e.g. a source
            checkout without metadata), ``"__version__"`` (the already-imported module's attribute) or
            ``"MCORE_COMPAT_VERSION"`` (the environment variable, which overrides the others and names the version of
            a tree whose version cannot be read).
        path: the directory ``megatron.core`` is imported from.
        distribution: the distribution that owns ``path`` (``None`` for a checkout on ``sys.path``).
        metadata_version: the version that distribution's metadata claims, if any.
        checkout: ``True`` when ``path`` belongs to no installed distribution (a source tree on ``sys.path``).
        warnings: the problems found (also emitted once as ``UserWarning``).
    """

    version: Version
    source: str
    path: Path
    distribution: str | None = None
    metadata_version: Version | None = None
    checkout: bool = False
    warnings: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        """One line: version, source and path."""
        where = "source checkout" if self.checkout else f"distribution {self.distribution}"
        return f"megatron-core {self.version} (from {self.source}; {where}; {self.path})"


def _locate_core_dir() -> Path:
    loaded = getattr(sys.modules.get("megatron.core"), "__file__", None)
    if loaded:
        return Path(loaded).resolve().parent
    try:
        spec = importlib.util.find_spec("megatron.core")
    except (ImportError, ValueError) as exc:  # megatron missing, or a broken namespace package
        raise MegatronNotFoundError(f"megatron-core is not installed: cannot find `megatron.core` ({exc}). "
                                    + _INSTALL_HINT) from exc
    if spec is None:
        raise MegatronNotFoundError("megatron-core is not installed: no module `megatron.core` on sys.path. "
                                    + _INSTALL_HINT)
    if spec.origin and spec.origin not in ("namespace", "built-in"):
        return Path(spec.origin).resolve().parent
    locations = list(spec.submodule_search_locations or [])
    if not locations:
        raise MegatronNotFoundError("`megatron.core` resolved to a namespace package with no files. " + _INSTALL_HINT)
    # A namespace `megatron/core` without __init__.py is not a real install (e.g. a stray directory).
    raise MegatronNotFoundError(
        f"`megatron.core` resolved to a directory without __init__.py ({locations[0]}), which is not a "
        f"Megatron-Core install. " + _INSTALL_HINT
    )


def _version_from_package_info(core_dir: Path) -> Version | None:
    """Evaluate ``package_info.py`` of ``core_dir`` without importing the package."""
    return _read_package_info(core_dir)[0]


def _read_package_info(core_dir: Path) -> tuple[Version | None, str]:
    """``(version, what was found)`` from ``package_info.py`` of ``core_dir``: the version (``None`` when there is
    none or it is not a PEP 440 version) and, for messages, what the file holds."""
    path = core_dir / "package_info.py"
    if not path.is_file():
        return None, "it has no megatron/core/package_info.py"
    source = path.read_text(encoding="utf-8")
    namespace: dict[str, object] = {}
    try:
        # package_info.py holds only constants (MAJOR, MINOR, PATCH, PRE_RELEASE, __version__, ...).
        tree = ast.parse(source, str(path))
        safe = ast.Module(body=[n for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))],
                          type_ignores=[])
        exec(compile(safe, str(path), "exec"), {"__builtins__": {"str": str, "int": int, "map": map}},
             namespace)
    except Exception:
        namespace = {}
    raw = namespace.get("__version__")
    if raw is None and "MAJOR" in namespace:
        raw = f"{namespace.get('MAJOR')}.{namespace.get('MINOR')}.{namespace.get('PATCH')}{namespace.get('PRE_RELEASE') or ''}"
    if raw is None:
        return None, f"its {path.name} defines no __version__ (nor MAJOR/MINOR/PATCH)"
    try:
        return Version(str(raw)), f"{path.name} says {raw}"
    except InvalidVersion:
        return None, f"its {path.name} says __version__ = {str(raw)!r}, which is not a PEP 440 version"


def _owning_distribution(core_dir: Path) -> md.Distribution | None:
    import importlib.metadata as md

    init = (core_dir / "__init__.py").resolve()
    dists: list[md.Distribution] = []
    for name in KNOWN_DISTRIBUTIONS:
        try:
            dists.append(md.distribution(name))
        except md.PackageNotFoundError:
            continue
    # Other names (forks, nightlies) installed next to the imported tree. Only that directory is searched:
    # md.packages_distributions() reads every distribution's files and costs ~1 s in a large environment.
    site = core_dir.parent.parent
    dists += [md.PathDistribution(p) for p in sorted(site.glob("*megatron*.dist-info"))]
    for dist in dists:
        try:
            located = Path(str(dist.locate_file("megatron/core/__init__.py"))).resolve()
        except Exception:
            continue
        if located == init:
            return dist
    return None


def _other_metadata() -> tuple[str, Version] | None:
    """Metadata of a megatron-core distribution that exists somewhere but does not own the imported files."""
    import importlib.metadata as md

    for name in KNOWN_DISTRIBUTIONS:
        try:
            return name, Version(md.version(name))
        except (md.PackageNotFoundError, InvalidVersion):
            continue
    return None


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, UserWarning, stacklevel=3)


@lru_cache(maxsize=1)
def _detect_cached() -> MegatronInfo:
    core_dir = _locate_core_dir()
    problems: list[str] = []
    imported = sys.modules.get("megatron.core")
    module_version: Version | None = None
    source = "package_info"
    if imported is not None and getattr(imported, "__version__", None):
        try:
            module_version = Version(str(imported.__version__))
            source = "__version__"
        except InvalidVersion:
            module_version = None
    if module_version is None:
        module_version = _version_from_package_info(core_dir)
        source = "package_info"

    dist = _owning_distribution(core_dir)
    dist_name = dist.metadata["Name"] if dist is not None else None
    meta_version: Version | None = None
    if dist is not None:
        try:
            meta_version = Version(dist.version)
        except InvalidVersion:
            meta_version = None
    else:
        other = _other_metadata()
        if other is not None:
            problems.append(
                f"distribution {other[0]} {other[1]} is installed, but `megatron.core` is imported from "
                f"{core_dir}, which it does not own (a checkout on PYTHONPATH shadows it); using the imported "
                f"module's version {module_version}."
            )
            meta_version = other[1]

    if module_version is None and meta_version is not None and dist is not None:
        module_version, source = meta_version, "metadata"
    elif module_version is not None and dist is not None and meta_version is not None:
        if meta_version == module_version:
            source = "metadata"
        else:
            problems.append(
                f"distribution metadata says {dist_name} {meta_version}, but the imported module at {core_dir} "
                f"says {module_version}; trusting the imported module."
            )
    override = os.environ.get("MCORE_COMPAT_VERSION")
    if override:  # read before giving up: it is the way out for a tree whose version cannot be read
        try:
            forced = Version(override)
        except InvalidVersion as exc:
            raise InvalidArgumentError(f"MCORE_COMPAT_VERSION={override!r} is not a valid version (e.g. "
                                       f"MCORE_COMPAT_VERSION=0.16.1)") from exc
        if module_version is None:
            module_version, source = forced, "MCORE_COMPAT_VERSION"
        elif forced != module_version:
            # a readable version is what runs: claiming another would pick the wrong adapters and patches
            raise InvalidArgumentError(
                f"MCORE_COMPAT_VERSION={override} disagrees with the installed megatron-core {module_version} at "
                f"{core_dir}; unset MCORE_COMPAT_VERSION (it names the version of a tree whose version cannot be "
                f"read) or install megatron-core=={override}")
    if module_version is None:
        raise MegatronVersionUnknownError(
            f"found megatron-core at {core_dir}, but cannot tell the version: no distribution metadata owns it and "
            f"{_read_package_info(core_dir)[1]}. Reinstall it with pip, or, for a checkout of a known release, set "
            f"MCORE_COMPAT_VERSION=<version> (e.g. MCORE_COMPAT_VERSION=0.16.1).",
            found_at=core_dir,
        )
    for p in problems:
        _warn_once(p)
    return MegatronInfo(
        version=module_version,
        source=source,
        path=core_dir,
        distribution=dist_name,
        metadata_version=meta_version,
        checkout=dist is None,
        warnings=tuple(problems),
    )


def detect() -> MegatronInfo:
    """Detect the megatron-core that ``import megatron.core`` gives (cached; see :func:`refresh`).

    Raises:
        MegatronNotFoundError: megatron-core is not importable, or its version cannot be told.
    """
    return _detect_cached()


def refresh() -> None:
    """Forget the cached detection (after changing ``sys.path`` or installing another release)."""
    _detect_cached.cache_clear()
    importlib.invalidate_caches()
