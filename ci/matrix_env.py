"""The environments of the test matrix: one shared base venv per Python, one ``--target`` tree per release.

Everything lives under ``<repo>/.cache`` (:class:`Layout`):

* ``base-py311``, ``base-py312``: one venv per Python, from ``[base."3.x"].requirements`` of
  ``matrix/versions.toml`` plus the test (and, for the tools Python, lint) tools. A stamp keyed by the
  requirements' hash marks it done; a file lock keeps parallel jobs from building it twice. A base whose stamp does
  not match is topped up with pip (built afresh if it is missing or broken; ``MCORE_COMPAT_REBUILD_BASE=1`` forces
  that).
* ``wheels/``: the megatron-core wheels (``pip download --no-deps --only-binary=:all:``).
* ``mc/<V>``: one release, ``pip install --no-deps --target`` of its wheel; for
  ``install = "unpack-wheel"`` only the wheel's ``megatron/`` tree (no metadata: the "source checkout" case).
  Both are byte-compiled at install: a session starts a dozen interpreters that import Megatron, and with
  ``PYTHONDONTWRITEBYTECODE`` set (as on the CI machine) each would otherwise compile it again (~0.8 s each,
  against ~2 s once).
* ``mcc/py3xx``: a real, non-editable install of this repository, rebuilt when its files change, so the tests
  import the installed package with its ``patches/`` and ``matrix/`` mappings.
* ``locks/``, ``logs/``.

A test run is ``<base python> -P ...`` with the environment of :meth:`MatrixEnv.session_env`. The interpreter of
``3.x`` is found by :func:`find_python`.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from ci.output import JobError, Out

if sys.version_info >= (3, 11):
    import tomllib as _toml
else:  # pragma: no cover - nox on Python 3.10
    import tomli as _toml

#: Test tools installed into every base, on top of its ``[base."3.x"].requirements`` (libcst: the tests of
#: ``mcore-compat scan --fix``, the ``scan`` extra; hypothesis: the generated settings tests; ray: the Ray worker
#: group example, examples/ray_rl).
TEST_TOOLS = ("pytest>=8", "pytest-xdist>=3", "libcst==1.8.6", "sybil==9.1.0", "hypothesis==6.155.2", "ray==2.60.0")
#: The Python that runs ``unit`` and ``lint``; its base also gets :data:`LINT_TOOLS`.
TOOLS_PYTHON = "3.11"
LINT_TOOLS = ("ruff==0.17.6", "mypy==2.4.0", "griffe==2.4.1")
#: The documentation site's tools (``nox -s docs``, a small venv of its own: mkdocstrings reads the source
#: statically, so neither torch nor mcore-compat is installed there).
DOCS_TOOLS = ("mkdocs==1.6.1", "mkdocs-material==9.6.14", "mkdocstrings==1.0.8", "mkdocstrings-python==2.0.11",
              "griffe==2.4.1")
#: Distributions whose versions are checked against each release's limits.
LIMITED_DISTS = ("torch", "numpy", "setuptools")
#: Environment variables a test run must not inherit.
_DROPPED_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "VIRTUAL_ENV", "MCORE_COMPAT_VERSION")
_PROBE = Path(__file__).resolve().parent / "probe.py"


class Release(Protocol):
    """What the machinery reads of ``mcore_compat.support.Release`` (loaded from source, so typed here)."""

    @property
    def version(self) -> Any: ...  # packaging.version.Version

    @property
    def python(self) -> str: ...

    @property
    def install(self) -> str: ...

    @property
    def wheel_python(self) -> str: ...

    @property
    def session(self) -> str: ...

    @property
    def tags(self) -> tuple[str, ...]: ...

    def unmet_limits(self, python: str, dists: Mapping[str, str | None]) -> list[str]: ...


def load_support(repo: Path) -> ModuleType:
    """The package ``mcore_compat/support/`` loaded from its source files under a name of its own (nox's
    interpreter lacks mcore_compat's deps; the package imports nothing else of mcore_compat).

    Args:
        repo: the repository root.

    Returns:
        The module (loaded once per process).
    """
    name = "_mcore_compat_support_for_nox"
    if name in sys.modules:
        return sys.modules[name]
    package = repo / "mcore_compat" / "support"
    spec = importlib.util.spec_from_file_location(name, package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def pytag(python: str) -> str:
    """``"3.11"`` -> ``"py311"``."""
    return "py" + python.replace(".", "")


def digest(data: Any) -> str:
    """A short, stable hash of JSON-able ``data`` (the value of a stamp file)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:20]


def read_stamp(path: Path) -> str:
    """A stamp file's value (``""`` if there is none)."""
    return path.read_text(encoding="utf-8").strip() if path.is_file() else ""


@dataclass(frozen=True)
class Layout:
    """Where everything lives, under ``<repo>/.cache``.

    Args:
        repo: the repository root.
    """

    repo: Path

    @property
    def cache(self) -> Path:
        """``.cache``."""
        return self.repo / ".cache"

    @property
    def wheels(self) -> Path:
        """``.cache/wheels``: downloaded megatron-core wheels."""
        return self.cache / "wheels"

    @property
    def mc_root(self) -> Path:
        """``.cache/mc``: one tree per release."""
        return self.cache / "mc"

    @property
    def mcc_root(self) -> Path:
        """``.cache/mcc``: the installed mcore-compat per Python."""
        return self.cache / "mcc"

    @property
    def logs(self) -> Path:
        """``.cache/logs``: one log (and JUnit/JSON reports) per job."""
        return self.cache / "logs"

    @property
    def locks(self) -> Path:
        """``.cache/locks``."""
        return self.cache / "locks"

    @property
    def summary_file(self) -> Path:
        """``.cache/matrix-summary.txt``: the matrix's summary line (``.ci/run`` repeats it last)."""
        return self.cache / "matrix-summary.txt"

    @property
    def docs_venv(self) -> Path:
        """``.cache/docs-venv``: the documentation site's tools (:data:`DOCS_TOOLS`), nothing else."""
        return self.cache / "docs-venv"

    @property
    def site(self) -> Path:
        """``.cache/site``: the built documentation site (``site_dir`` of ``mkdocs.yml``)."""
        return self.cache / "site"

    def base_dir(self, python: str) -> Path:
        """``.cache/base-py311``."""
        return self.cache / f"base-{pytag(python)}"

    def base_python(self, python: str) -> Path:
        """The base venv's interpreter."""
        return self.base_dir(python) / "bin" / "python"

    def mc_dir(self, release: Release) -> Path:
        """``.cache/mc/<V>``: the directory put first on ``PYTHONPATH`` for a release."""
        return self.mc_root / str(release.version)

    def mcc_dir(self, python: str) -> Path:
        """``.cache/mcc/py311``: the installed mcore-compat for ``python``."""
        return self.mcc_root / pytag(python)


# ============================================================================================ locks
@contextlib.contextmanager
def file_lock(locks: Path, name: str, out: Out) -> Iterator[None]:
    """An exclusive lock shared by every process and thread (``flock`` on ``<locks>/<name>.lock``).

    Args:
        locks: the directory of lock files (created if missing).
        name: the lock's name.
        out: where "waiting for the lock" is said when another holder has it.
    """
    locks.mkdir(parents=True, exist_ok=True)
    with (locks / f"{name}.lock").open("w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            out.say(f"waiting for the lock {name} (another session is preparing it)")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# ============================================================================================ interpreters
_FOUND_PYTHONS: dict[str, str] = {}
_PYTHON_PROBE = "import sys, venv, ensurepip; print('%d.%d' % sys.version_info[:2])"


def interpreter_candidates(python: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """Where an interpreter of ``python`` (``"3.12"``) may be, best first, without duplicates.

    ``$MCORE_COMPAT_PYTHON_3_12``, ``python3.12`` on ``PATH``, ``$PYENV_ROOT/versions/3.12.*`` (newest first),
    then ``/usr/local/bin`` and ``/usr/bin``.

    Args:
        python: ``"3.x"``.
        environ: the environment to read (``None``: ``os.environ``).
    """
    env = os.environ if environ is None else environ
    override = env.get(f"MCORE_COMPAT_PYTHON_{python.replace('.', '_')}")
    pyenv = env.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    found = [override, shutil.which(f"python{python}", path=env.get("PATH"))]
    found += sorted(glob.glob(f"{pyenv}/versions/{python}.*/bin/python{python}"), reverse=True)
    found += [f"/usr/local/bin/python{python}", f"/usr/bin/python{python}"]
    return [c for c in dict.fromkeys(found) if c]


def find_python(python: str, environ: Mapping[str, str] | None = None) -> str:
    """An interpreter of ``python`` that runs and can make venvs (pyenv shims that fail are skipped).

    The answer is cached for the process.

    Args:
        python: ``"3.x"``.
        environ: the environment to read (``None``: ``os.environ``).

    Returns:
        The interpreter's path.

    Raises:
        JobError: no candidate of :func:`interpreter_candidates` works.
    """
    if python in _FOUND_PYTHONS:
        return _FOUND_PYTHONS[python]
    candidates = interpreter_candidates(python, environ)
    for cand in candidates:
        try:
            proc = subprocess.run([cand, "-c", _PYTHON_PROBE], capture_output=True, text=True, timeout=60,
                                  check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if proc.returncode == 0 and proc.stdout.strip() == python:
            _FOUND_PYTHONS[python] = cand
            return cand
    raise JobError(f"no working Python {python} interpreter with venv/ensurepip found (tried "
                   f"{', '.join(candidates)}); set MCORE_COMPAT_PYTHON_{python.replace('.', '_')}")


# ============================================================================================ wheels
def wheel_fits(path: Path, python: str) -> bool:
    """Whether a wheel file name's python tag fits ``python`` (``cp311``, ``py311`` or ``py3``)."""
    tag = path.name[:-4].split("-")[-3]
    short = python.replace(".", "")
    return any(t in (f"cp{short}", "py3", f"py{short}") for t in tag.split("."))


def unpack_megatron_tree(wheel: Path, dest: Path, out: Out) -> None:
    """Unzip only the wheel's ``megatron/`` tree (no ``*.dist-info``): a source checkout on ``sys.path``.

    Raises:
        JobError: the wheel has no ``megatron/`` tree.
    """
    out.say(f"unpacking the megatron/ tree of {wheel.name} into {dest} (no metadata)")
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.startswith("megatron/")]
        if not members:
            raise JobError(f"{wheel.name} has no megatron/ tree")
        zf.extractall(dest, members)


def _replace_dir(tmp: Path, target: Path) -> None:
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


# ============================================================================================ the environments
@dataclass
class MatrixEnv:
    """Builds and describes the environments of one nox run.

    Args:
        layout: where things live.
        matrix: ``mcore_compat.support.Matrix`` of the repository (base requirements of each Python).
        tools_python: the Python whose base also gets the lint tools.
    """

    layout: Layout
    matrix: Any
    tools_python: str = TOOLS_PYTHON
    _mcc_done: dict[str, str] = field(default_factory=dict, repr=False)
    _sources_digest: str | None = field(default=None, repr=False)
    _digest_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def for_repo(cls, repo: Path) -> MatrixEnv:
        """The environments of ``repo``, reading ``repo/matrix`` (results are recorded there too)."""
        support = load_support(repo)
        return cls(Layout(repo), support.Matrix(repo / "matrix", results_dir=repo / "matrix"))

    def releases(self) -> list[Release]:
        """The releases of ``matrix/versions.toml``, oldest first."""
        return list(self.matrix.releases())

    def _lock(self, name: str, out: Out) -> contextlib.AbstractContextManager[None]:
        return file_lock(self.layout.locks, name, out)

    # ---------------------------------------------------------------------------------------- base venvs
    def base_requirements(self, python: str) -> list[str]:
        """What the base of ``python`` gets: versions.toml's requirements plus the test (and lint) tools."""
        extra = list(TEST_TOOLS) + (list(LINT_TOOLS) if python == self.tools_python else [])
        return list(self.matrix.base_requirements(python)) + extra

    def _probe(self, python: str, command: str, items: Sequence[str]) -> Any | None:
        """Run ``ci/probe.py`` in the base; ``None`` if the base is missing or the probe fails."""
        exe = self.layout.base_python(python)
        if not exe.exists():
            return None
        proc = subprocess.run([str(exe), "-I", str(_PROBE), command, json.dumps(list(items))],
                              capture_output=True, text=True, check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def unmet(self, python: str, requirements: Sequence[str]) -> list[str] | None:
        """Requirements the base does not satisfy (``None``: the base is missing or broken)."""
        found = self._probe(python, "unmet", requirements)
        return None if found is None else list(found)

    def ensure_base(self, python: str, out: Out) -> Path:
        """Build (once) the shared base venv of ``python``.

        A stamp with the hash of the requirements marks a finished base. Without it, a base that exists and
        works is topped up with ``pip install``; a missing or broken one (or ``MCORE_COMPAT_REBUILD_BASE=1``) is
        rebuilt.

        Returns:
            The base's interpreter.

        Raises:
            JobError: no interpreter, a failed pip, or the base still misses requirements afterwards.
        """
        layout = self.layout
        reqs = self.base_requirements(python)
        stamp_value = digest({"python": python, "requirements": reqs})
        stamp = layout.base_dir(python) / ".mcore-compat-stamp"
        exe = layout.base_python(python)
        with self._lock(f"base-{pytag(python)}", out):
            if read_stamp(stamp) == stamp_value and exe.exists():
                return exe
            start = time.monotonic()
            unmet = None if os.environ.get("MCORE_COMPAT_REBUILD_BASE") == "1" else self.unmet(python, reqs)
            if unmet is None:
                out.say(f"building the base environment {layout.base_dir(python)} (Python {python})")
                shutil.rmtree(layout.base_dir(python), ignore_errors=True)
                out.run([find_python(python), "-m", "venv", layout.base_dir(python)])
            if unmet is None or unmet:
                out.say(f"installing into {layout.base_dir(python)}: {' '.join(reqs)}"
                        + (f" (unmet: {unmet})" if unmet else ""))
                out.run([exe, "-m", "pip", "install", *reqs])
            still = self.unmet(python, reqs)
            if still is None or still:
                raise JobError(f"the base {layout.base_dir(python)} still does not satisfy "
                               f"{still if still else 'its requirements (the probe failed)'}")
            stamp.write_text(stamp_value + "\n", encoding="utf-8")
            out.say(f"base {layout.base_dir(python)} ready in {time.monotonic() - start:.1f}s")
        return exe

    def ensure_docs_venv(self, out: Out) -> Path:
        """Build (once) ``.cache/docs-venv`` with :data:`DOCS_TOOLS` on the tools Python; returns its interpreter.

        A stamp with the hash of the tools marks it done; a changed list is topped up with pip, a missing
        interpreter (or ``MCORE_COMPAT_REBUILD_BASE=1``) rebuilds it. Neither torch nor mcore-compat goes in:
        mkdocstrings reads the sources statically (about 30 s of pip on a fresh machine, then nothing).

        Raises:
            JobError: no interpreter or a failed pip.
        """
        venv = self.layout.docs_venv
        exe = venv / "bin" / "python"
        stamp = venv / ".mcore-compat-stamp"
        stamp_value = digest({"python": self.tools_python, "requirements": list(DOCS_TOOLS)})
        with self._lock("docs-venv", out):
            if read_stamp(stamp) == stamp_value and exe.exists():
                return exe
            if not exe.exists() or os.environ.get("MCORE_COMPAT_REBUILD_BASE") == "1":
                out.say(f"building the docs environment {venv} (Python {self.tools_python})")
                shutil.rmtree(venv, ignore_errors=True)
                out.run([find_python(self.tools_python), "-m", "venv", venv])
            out.run([exe, "-m", "pip", "install", *DOCS_TOOLS])
            stamp.write_text(stamp_value + "\n", encoding="utf-8")
        return exe

    def check_limits(self, release: Release, out: Out) -> None:
        """Fail unless the release's limits (python, torch, numpy, setuptools) hold in its base.

        Raises:
            JobError: a limit does not hold (the message names it and what to fix).
        """
        found = self._probe(release.python, "versions", LIMITED_DISTS)
        if found is None:
            raise JobError(f"cannot read the versions installed in {self.layout.base_dir(release.python)}")
        problems = release.unmet_limits(found["python"], found["dists"])
        if problems:
            raise JobError(f"megatron-core {release.version}: the base {self.layout.base_dir(release.python)} "
                           f"breaks the release's limits from matrix/versions.toml: {'; '.join(problems)}. Fix "
                           f'[base."{release.python}"] or the release entry.')
        out.say(f"limits of {release.version} hold: python {found['python']}, "
                + ", ".join(f"{k} {v}" for k, v in found["dists"].items()))

    # ---------------------------------------------------------------------------------------- megatron-core
    def ensure_wheel(self, release: Release, out: Out) -> Path:
        """The release's wheel in ``.cache/wheels`` (downloaded once).

        Raises:
            JobError: pip failed or left no fitting wheel.
        """
        python = release.wheel_python if release.install == "unpack-wheel" else release.python
        wheels = self.layout.wheels
        pattern = f"megatron_core-{release.version}-*.whl"

        def _cached() -> Path | None:
            return next((p for p in sorted(wheels.glob(pattern)) if wheel_fits(p, python)), None)

        if (found := _cached()) is not None:
            return found
        with self._lock(f"wheel-{release.version}", out):
            if (found := _cached()) is not None:
                return found
            wheels.mkdir(parents=True, exist_ok=True)
            out.run([self.layout.base_python(release.python), "-m", "pip", "download", "--no-deps",
                     "--only-binary=:all:", "--python-version", python, "-d", wheels,
                     f"megatron-core=={release.version}"])
            if (found := _cached()) is None:
                raise JobError(f"pip download left no {pattern} for Python {python} in {wheels}")
            return found

    def ensure_mc(self, release: Release, out: Out) -> Path:
        """Install (once) the release into ``.cache/mc/<V>``; returns that directory."""
        wheel = self.ensure_wheel(release, out)
        target = self.layout.mc_dir(release)
        stamp = self.layout.mc_root / f"{release.version}.stamp"
        stamp_value = digest({"wheel": wheel.name, "install": release.install, "compiled": True})
        with self._lock(f"mc-{release.version}", out):
            if read_stamp(stamp) == stamp_value and target.is_dir():
                return target
            tmp = target.with_name(target.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            exe = self.layout.base_python(release.python)
            if release.install == "unpack-wheel":
                unpack_megatron_tree(wheel, tmp, out)
                out.run([exe, "-m", "compileall", "-q", tmp], check=False)  # a file that does not compile stays .py
            else:
                out.run([exe, "-m", "pip", "install", "--no-deps", "--target", tmp, wheel])
            _replace_dir(tmp, target)
            stamp.write_text(stamp_value + "\n", encoding="utf-8")
        return target

    # ---------------------------------------------------------------------------------------- mcore-compat
    def package_sources(self) -> list[Path]:
        """The files and directories a wheel of this repository is built from."""
        repo = self.layout.repo
        pyproject = _toml.loads((repo / "pyproject.toml").read_text(encoding="utf-8"))
        dirs = set(pyproject.get("tool", {}).get("setuptools", {}).get("package-dir", {}).values()) | {"mcore_compat"}
        files = [repo / "pyproject.toml", *sorted(repo.glob("README*")), *sorted(repo.glob("LICENSE*"))]
        return files + [repo / d for d in sorted(dirs)]

    def source_files(self) -> Iterator[Path]:
        """Every file of :meth:`package_sources` (no ``__pycache__``, no ``*.pyc``), in a stable order."""
        for src in self.package_sources():
            if src.is_file():
                yield src
            elif src.is_dir():
                yield from sorted(p for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                                  and not p.name.endswith(".pyc"))

    def sources_digest(self) -> str:
        """A hash of the package's files, taken once per run (both Pythons then install the same wheel)."""
        with self._digest_lock:
            if self._sources_digest is None:
                h = hashlib.sha256()
                for path in self.source_files():
                    h.update(str(path.relative_to(self.layout.repo)).encode() + b"\0" + path.read_bytes() + b"\0")
                self._sources_digest = h.hexdigest()[:20]
            return self._sources_digest

    def ensure_mcc(self, python: str, out: Out) -> Path:
        """Install this repository (non-editable) into ``.cache/mcc/py3xx``; returns that directory.

        Once per run and Python: later jobs of the same run reuse it even if the sources change meanwhile (so
        every session of a matrix tests the same code). Across runs it is reinstalled when the files changed.
        """
        target = self.layout.mcc_dir(python)
        with self._lock(f"mcc-{pytag(python)}", out):
            if python in self._mcc_done and target.is_dir():
                return target
            source_digest = self.sources_digest()
            stamp = self.layout.mcc_root / f"{pytag(python)}.stamp"
            if read_stamp(stamp) != source_digest or not target.is_dir():
                wheel = self._build_mcc_wheel(python, source_digest, out)
                tmp = target.with_name(target.name + ".tmp")
                shutil.rmtree(tmp, ignore_errors=True)
                out.run([self.layout.base_python(python), "-m", "pip", "install", "--no-deps", "--target", tmp,
                         wheel])
                _replace_dir(tmp, target)
                stamp.write_text(source_digest + "\n", encoding="utf-8")
            self._mcc_done[python] = source_digest
        return target

    def _build_mcc_wheel(self, python: str, source_digest: str, out: Out) -> Path:
        """A wheel of this repository for ``source_digest``, built from a clean copy (the tree is untouched)."""
        root = self.layout.mcc_root
        dist = root / "dist" / source_digest
        with self._lock("mcc-wheel", out):
            found = sorted(dist.glob("mcore_compat-*.whl"))
            if found:
                return found[0]
            src = root / "src"
            shutil.rmtree(src, ignore_errors=True)
            for path in self.source_files():
                dest = src / path.relative_to(self.layout.repo)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, dest)
            shutil.rmtree(root / "dist", ignore_errors=True)
            out.run([self.layout.base_python(python), "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                     "-w", dist, src])
            found = sorted(dist.glob("mcore_compat-*.whl"))
            if not found:
                raise JobError(f"building the mcore-compat wheel left nothing in {dist}")
            return found[0]

    # ---------------------------------------------------------------------------------------- test runs
    def session_env(self, python: str, release: Release | None = None) -> dict[str, str]:
        """The environment of a test run.

        ``PYTHONPATH`` is the release's tree (if any) and the installed mcore-compat; the base's ``bin`` leads
        ``PATH``; ``OMP_NUM_THREADS=1``; the caller's ``PYTHONPATH``, ``VIRTUAL_ENV``, ... are dropped.
        """
        env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
        paths = ([str(self.layout.mc_dir(release))] if release is not None else []) + [
            str(self.layout.mcc_dir(python))]
        env.update(PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1", PYTHONNOUSERSITE="1",
                   PATH=os.pathsep.join([str(self.layout.base_python(python).parent), env.get("PATH", "")]))
        return env
