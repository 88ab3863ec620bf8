"""The support matrix: which Megatron-Core releases mcore-compat supports, on what, and how they fared.

The data lives in ``matrix/versions.toml`` (the single source of truth of supported releases) and
``matrix/results.json`` (the recorded CPU/GPU results); both are installed as package data of
``mcore_compat.matrix``. ``matrix/README.md`` is generated from them by :func:`render_table`::

    python -m mcore_compat.support render            # regenerate matrix/README.md in the source tree
    python -m mcore_compat.support render --check    # exit 1 if matrix/README.md is stale
    python -m mcore_compat.support status 0.16.0rc1  # is this release supported?
    python -m mcore_compat.support list              # the releases, with their tags

This module needs only the standard library and ``packaging`` (plus ``tomli`` on Python 3.10), and imports nothing
else from ``mcore_compat``: ``noxfile.py`` loads it straight from the source file.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.resources
import json
import os
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

if sys.version_info >= (3, 11):
    import tomllib as _toml
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as _toml

if TYPE_CHECKING:  # pragma: no cover
    from importlib.resources.abc import Traversable

__all__ = [
    "INSTALL_KINDS",
    "RESULT_KINDS",
    "Matrix",
    "Release",
    "SupportStatus",
    "base_requirements",
    "main",
    "record_result",
    "releases",
    "render_table",
    "results",
    "status",
]

#: How a release is put on ``sys.path`` in the matrix (see ``matrix/versions.toml``).
INSTALL_KINDS = ("wheel", "unpack-wheel")
#: The kinds of recorded results.
RESULT_KINDS = ("cpu", "gpu")
_RESULT_VALUES = ("pass", "fail")
_RELEASE_KEYS = frozenset({"version", "python", "requires_python", "torch", "numpy", "setuptools", "install",
                           "wheel_python", "notes", "tags"})
_LIMIT_FIELDS = ("requires_python", "torch", "numpy", "setuptools")
_RESULTS_SCHEMA = 1
_VERSIONS_FILE = "versions.toml"
_RESULTS_FILE = "results.json"
_README_FILE = "README.md"


# ----------------------------------------------------------------------------------------------- data classes
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
        return {name: getattr(self, name) for name in _LIMIT_FIELDS if getattr(self, name)}

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


# ----------------------------------------------------------------------------------------------- locating files
def _source_matrix_dir() -> Path | None:
    """``matrix/`` of the source tree this module (or the current directory) belongs to, if any."""
    for root in (Path(__file__).resolve().parents[1], Path.cwd()):
        candidate = root / "matrix"
        if (candidate / _VERSIONS_FILE).is_file() and (root / "pyproject.toml").is_file():
            return candidate
    return None


def _package_matrix_dir() -> Traversable | None:
    """The installed package data ``mcore_compat.matrix`` (``None`` in a plain source checkout)."""
    try:
        data = importlib.resources.files("mcore_compat.matrix")
    except (ModuleNotFoundError, TypeError):
        return None
    return data if data.joinpath(_VERSIONS_FILE).is_file() else None


def _default_dir() -> Traversable:
    found = _package_matrix_dir() or _source_matrix_dir()
    if found is None:
        raise FileNotFoundError("cannot find the support matrix: neither the package data mcore_compat.matrix nor "
                                "a source tree's matrix/versions.toml is available")
    return found


def _writable_dir(path: str | os.PathLike[str] | None) -> Path:
    if path is not None:
        return Path(path)
    found = _source_matrix_dir()
    if found is None:
        raise FileNotFoundError("results are written to the source tree's matrix/ directory, which was not found "
                                "(run from the repository root or pass path=...)")
    return found


# ----------------------------------------------------------------------------------------------- parsing
def _python_key(python: str) -> str:
    """``"3.11.7"`` / ``"3.11"`` / ``"py311"`` -> ``"3.11"``."""
    text = python.removeprefix("py")
    if "." not in text and len(text) >= 2:
        text = f"{text[0]}.{text[1:]}"
    parts = text.split(".")
    if len(parts) < 2 or not all(p.isdigit() for p in parts[:2]):
        raise ValueError(f"not a Python version: {python!r}")
    return f"{parts[0]}.{parts[1]}"


def _check_specifier(version: str, name: str, value: str) -> None:
    if value:
        try:
            SpecifierSet(value)
        except InvalidSpecifier as exc:
            raise ValueError(f"versions.toml, release {version}: {name} = {value!r} is not a specifier") from exc


def _parse_release(entry: Mapping[str, Any], bases: Mapping[str, Any]) -> Release:
    raw_version = str(entry.get("version", ""))
    unknown = set(entry) - _RELEASE_KEYS
    if unknown:
        raise ValueError(f"versions.toml, release {raw_version}: unknown keys {sorted(unknown)}")
    try:
        version = Version(raw_version)
    except InvalidVersion as exc:
        raise ValueError(f"versions.toml: bad release version {raw_version!r}") from exc
    python = _python_key(str(entry.get("python", "")))
    if python not in bases:
        raise ValueError(f"versions.toml, release {version}: no [base.\"{python}\"] table for python {python}")
    install = str(entry.get("install", "wheel"))
    if install not in INSTALL_KINDS:
        raise ValueError(f"versions.toml, release {version}: install must be one of {INSTALL_KINDS}")
    wheel_python = str(entry.get("wheel_python", ""))
    if install == "unpack-wheel" and not wheel_python:
        raise ValueError(f"versions.toml, release {version}: install = 'unpack-wheel' needs wheel_python")
    for name in _LIMIT_FIELDS:
        _check_specifier(raw_version, name, str(entry.get(name, "")))
    return Release(version=version, python=python, install=install, wheel_python=wheel_python,
                   notes=str(entry.get("notes", "")), tags=tuple(str(t) for t in entry.get("tags", ())),
                   **{name: str(entry.get(name, "")) for name in _LIMIT_FIELDS})


def _computed_tags(release: Release, all_releases: list[Release]) -> tuple[str, ...]:
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


# ----------------------------------------------------------------------------------------------- the matrix
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
            self._data: Traversable = _default_dir()
        elif isinstance(data_dir, (str, os.PathLike)):
            self._data = Path(data_dir)
        else:
            self._data = data_dir
        self._results_dir = Path(results_dir) if results_dir is not None else None

    # -- reading
    def raw(self) -> dict[str, Any]:
        """The parsed ``versions.toml``."""
        return _toml.loads(self._data.joinpath(_VERSIONS_FILE).read_text(encoding="utf-8"))

    def releases(self) -> list[Release]:
        """All listed releases, oldest first, with their computed tags."""
        raw = self.raw()
        bases = raw.get("base", {})
        parsed = sorted((_parse_release(e, bases) for e in raw.get("release", [])), key=lambda r: r.version)
        seen = [r.version for r in parsed]
        if len(set(seen)) != len(seen):
            raise ValueError("versions.toml lists a release twice")
        return [Release(**{**vars(r), "tags": _computed_tags(r, parsed)}) for r in parsed]

    def release(self, version: str | Version) -> Release | None:
        """The listed release equal to ``version``, or ``None``."""
        wanted = Version(str(version))
        return next((r for r in self.releases() if r.version == wanted), None)

    def pythons(self) -> list[str]:
        """The Python versions that have a base environment (``["3.11", "3.12"]``)."""
        return sorted(self.raw().get("base", {}), key=lambda p: tuple(int(x) for x in p.split(".")))

    def base_requirements(self, python: str) -> list[str]:
        """The requirements of the shared base environment of ``python`` (``"3.11"`` or ``"3.11.7"``)."""
        key = _python_key(python)
        bases = self.raw().get("base", {})
        if key not in bases:
            raise KeyError(f"versions.toml has no [base.\"{key}\"] table (have: {sorted(bases)})")
        return [str(r) for r in bases[key].get("requirements", [])]

    def results(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Recorded results: ``{"0.16.1": {"cpu": {"result": "pass", "date": ..., ...}, "gpu": {...}}}``."""
        source = self._results_dir / _RESULTS_FILE if self._results_dir else self._data.joinpath(_RESULTS_FILE)
        if not source.is_file():
            return {}
        data = json.loads(source.read_text(encoding="utf-8"))
        return {str(k): dict(v) for k, v in data.get("results", {}).items()}

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
        """
        release = self.release(version)
        if release is None:
            raise ValueError(f"{version} is not a listed release; results are recorded only for listed releases")
        if kind not in RESULT_KINDS:
            raise ValueError(f"kind must be one of {RESULT_KINDS}, not {kind!r}")
        if result.get("result") not in _RESULT_VALUES:
            raise ValueError(f"result['result'] must be one of {_RESULT_VALUES}, not {result.get('result')!r}")
        entry = {"date": _dt.datetime.now(_dt.timezone.utc).date().isoformat(), **dict(result)}
        json.dumps(entry)  # fail early on values that cannot be stored
        target = _writable_dir(self._results_dir) / _RESULTS_FILE
        data: dict[str, Any] = {"schema": _RESULTS_SCHEMA, "results": {}}
        if target.is_file():
            data = json.loads(target.read_text(encoding="utf-8"))
        per_version = data.setdefault("results", {})
        per_version.setdefault(str(release.version), {})[kind] = entry
        data["results"] = {k: per_version[k] for k in sorted(per_version, key=Version)}
        _atomic_write(target, json.dumps(data, indent=2, sort_keys=False) + "\n")
        return entry

    def render_table(self) -> str:
        """``matrix/README.md``: the support table and the base environments."""
        return _render(self.releases(), self.results(), {p: self.base_requirements(p) for p in self.pythons()})

    def write_readme(self) -> Path:
        """Write :meth:`render_table` to the source tree's ``matrix/README.md``; returns the path."""
        target = _writable_dir(self._results_dir) / _README_FILE
        _atomic_write(target, self.render_table())
        return target


def _atomic_write(target: Path, text: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------------------------- rendering
_HEADER = """\
<!-- Generated from matrix/versions.toml and matrix/results.json by `python -m mcore_compat.support render`.
     Do not edit by hand: edit versions.toml (releases) or run `python3 -m nox -s matrix` (CPU results)
     or scripts/record_gpu_results.py (GPU results). -->
# Supported Megatron-Core releases

Every release below has its own nox session (`nox -s mcore-<version>`, `nox -l` lists them) that runs the
`mcore`-marked tests against that exact release on a CPU-only torch. **min**/**latest** mark the earliest and
latest tested patch of each minor. A version that is not listed (a release candidate, a source checkout, a newer
release) is looked up by `mcore-compat doctor`, which names the nearest tested releases.

**CPU**: the release's nox session (pytest counts) and its `mcore-compat self-check --nproc 2 --sweep --bind`
(the standard configurations the release can run: DP=2 with the distributed optimizer on and off, TP=2 with
sequence parallelism, PP=2 with tied embeddings, PP=2 with virtual stages, overlapped DP, MoE with expert
parallelism), on gloo. **Faults caught**: the fault-injection suite (`tests/test_selfcheck_real.py`), every fault
that can exist on the release injected where the real bug acts, in fp32 and bf16; a fault counts as caught when
the self-check FAILS naming the right check (and the clean configurations PASS). **GPU**: `scripts/gpu_matrix.py`
on NVIDIA H200 with NCCL: the self-check in bf16 with `--bind` on 1 GPU (distributed optimizer on and off, lr
1e-2 and 1e-6) and, where a 2-GPU machine was lent, the standard sweep on 2 GPUs; per-configuration results are
in `results.json`, the raw runs in `gpu-runs/` (`python3 scripts/record_gpu_results.py` re-records them).
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") if text else "—"


def _limits_cell(release: Release) -> str:
    names = {"requires_python": "python", "torch": "torch", "numpy": "numpy", "setuptools": "setuptools"}
    return ", ".join(f"{names[k]}{v}" for k, v in release.limits().items()) or "—"


def _install_cell(release: Release) -> str:
    if release.install == "unpack-wheel":
        return f"cp{release.wheel_python.replace('.', '')} wheel's `megatron/` on sys.path (no metadata)"
    return "`pip install megatron-core==" + str(release.version) + "`"


def _result_cell(result: Mapping[str, Any] | None) -> str:
    if not result:
        return "—"
    text = f"{result.get('result', '?')} ({result.get('date', '?')})"
    configs = result.get("configurations")
    if isinstance(configs, list) and configs and all(isinstance(c, Mapping) for c in configs):
        gpus = sorted({int(c.get("gpus", 1)) for c in configs})
        good = sum(bool(c.get("ok")) for c in configs)
        where = "/".join(map(str, gpus)) + " GPU" + ("s" if gpus != [1] else "")
        return _cell(f"{text}: {good}/{len(configs)} configurations on {where}")
    counts = [f"{result[k]} {k}" for k in ("passed", "failed", "errors", "skipped") if result.get(k)]
    if counts:
        text += ": " + ", ".join(counts)
    check = result.get("self_check")
    if isinstance(check, Mapping) and check.get("summary"):
        text += f"; self-check {check['summary']}"
    return _cell(text)


def _faults_cell(result: Mapping[str, Any] | None) -> str:
    """``28/28 (100 %)`` from a CPU result's ``fault_detection`` (``—`` when not recorded)."""
    faults = (result or {}).get("fault_detection")
    if not isinstance(faults, Mapping) or not faults.get("faults"):
        return "—"
    caught, total = int(faults.get("caught", 0)), int(faults["faults"])
    text = f"{caught}/{total} ({100.0 * caught / total:.0f} %)"
    if faults.get("clean") and faults.get("clean_pass") != faults.get("clean"):
        text += f"; clean {faults.get('clean_pass')}/{faults.get('clean')}"
    return text


def _render(releases: Iterable[Release], recorded: Mapping[str, Mapping[str, Any]],
            bases: Mapping[str, list[str]]) -> str:
    lines = [_HEADER, "| megatron-core | tags | Python | limits | install | CPU | faults caught | GPU | notes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in releases:
        res = recorded.get(str(r.version), {})
        tags = ", ".join(t for t in r.tags if t in ("min", "latest", "oldest", "newest"))
        lines.append(f"| {r.version} | {tags} | {r.python} | {_limits_cell(r)} | {_install_cell(r)} | "
                     f"{_result_cell(res.get('cpu'))} | {_faults_cell(res.get('cpu'))} | "
                     f"{_result_cell(res.get('gpu'))} | {_cell(r.notes)} |")
    lines += ["", "## Base environments", "",
              "Each Python has one shared environment; a release's limits must hold in its base "
              "(the noxfile checks this before running a session).", ""]
    lines += [f"* Python {p}: " + ", ".join(f"`{req}`" for req in reqs) for p, reqs in bases.items()]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------- module-level API
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
    target = _writable_dir(path)
    return Matrix(target, results_dir=target).record_result(version, kind, result)


def render_table() -> str:
    """The generated ``matrix/README.md`` (support table, results, base environments)."""
    return Matrix().render_table()


# ----------------------------------------------------------------------------------------------- CLI
def _cmd_render(args: argparse.Namespace) -> int:
    target = _writable_dir(args.matrix_dir)
    matrix = Matrix(target, results_dir=target)
    readme = target / _README_FILE
    if args.check:
        current = readme.read_text(encoding="utf-8") if readme.is_file() else ""
        if current != matrix.render_table():
            print(f"{readme} is stale: run `python -m mcore_compat.support render`", file=sys.stderr)
            return 1
        print(f"{readme} is up to date")
        return 0
    print(f"wrote {matrix.write_readme()}")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    st = Matrix(args.matrix_dir).status(args.version)
    print(json.dumps(st.as_dict(), indent=2) if args.json else st.summary())
    return 0 if st.listed else 1


def _cmd_list(args: argparse.Namespace) -> int:
    for r in Matrix(args.matrix_dir).releases():
        print(f"{r.version!s:<8} python {r.python}  {r.session:<14} tags={','.join(r.tags)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m mcore_compat.support {render,status,list}``."""
    parser = argparse.ArgumentParser(prog="python -m mcore_compat.support", description=__doc__.split("\n")[0])
    parser.add_argument("--matrix-dir", default=None, help="the matrix/ directory (default: the source tree's)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("render", help="regenerate matrix/README.md in the source tree")
    p.add_argument("--check", action="store_true", help="exit 1 if matrix/README.md is stale, write nothing")
    p.set_defaults(func=_cmd_render)
    p = sub.add_parser("status", help="is VERSION supported? (exit 1 unless it is a listed release)")
    p.add_argument("version")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_status)
    sub.add_parser("list", help="the listed releases").set_defaults(func=_cmd_list)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
