"""nox sessions of mcore-compat, generated from ``matrix/versions.toml`` (the single source of truth of releases).

Sessions (``nox -l`` lists them):

* ``mcore-<V>``, one per supported release (tags ``cpu``, ``min``/``latest``, ``oldest``/``newest``, ``py311``/
  ``py312``): start-up check, then ``pytest tests -m mcore`` against exactly megatron-core ``V``.
  ``nox -t py311``, ``nox -t latest`` select groups; extra arguments go to pytest (``nox -s mcore-0.16.1 -- -x``).
* ``unit``: the tests that need no megatron-core (``pytest -m "not mcore"``).
* ``lint``: ``ruff check .``.
* ``matrix``: unit + lint + every release session, 2 at a time, records each release's CPU result into
  ``matrix/results.json``, regenerates ``matrix/README.md`` and ends with one pytest-style summary line.
  Options after ``--``: ``--jobs N``, ``--tag TAG`` (only releases with that tag), ``--no-record``.

No session creates its own virtualenv (``venv_backend="none"``). Everything lives under ``.cache/``:

* ``base-py311``, ``base-py312``: one shared venv per Python, from ``[base."3.x"].requirements`` plus the test
  tools. A stamp keyed by the requirements' hash marks it done; a file lock keeps parallel sessions from building
  it twice. A base whose stamp does not match is topped up with pip (a fresh build if it is missing or broken;
  ``MCORE_COMPAT_REBUILD_BASE=1`` forces one).
* ``wheels/``: the megatron-core wheels (``pip download --no-deps --only-binary=:all:``).
* ``mc/<V>``: one release, ``pip install --no-deps --no-compile --target`` of its wheel; for
  ``install = "unpack-wheel"`` only the wheel's ``megatron/`` tree (no metadata: the "source checkout" case).
* ``mcc/py3xx``: a real, non-editable install of this repository (rebuilt whenever its files change), so the tests
  import the installed package with its ``patches/`` and ``matrix/`` mappings.

A session runs ``<base python> -P ...`` with ``PYTHONPATH=.cache/mc/<V>:.cache/mcc/py3xx`` (``-P`` keeps the
repository root off ``sys.path``) and ``OMP_NUM_THREADS=1``. The interpreter for ``3.x`` is found on ``PATH``
(``python3.x``), under ``$PYENV_ROOT/versions/3.x.*`` or in ``$MCORE_COMPAT_PYTHON_3_x``.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import fcntl
import functools
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import IO, Any
from xml.etree import ElementTree

import nox

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - nox on Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent
CACHE = REPO / ".cache"
WHEELS = CACHE / "wheels"
MC_ROOT = CACHE / "mc"
MCC_ROOT = CACHE / "mcc"
LOGS = CACHE / "logs"
LOCKS = CACHE / "locks"
SUMMARY_FILE = CACHE / "matrix-summary.txt"

#: Test tools installed into every base, on top of its ``[base."3.x"].requirements``.
TEST_TOOLS = ("pytest>=8", "pytest-xdist>=3")
#: What pytest collects in every session: the suite and the PPO-actor example client (issue: a real client).
TEST_PATHS = ("tests", "examples/ppo_actor/tests")
#: The Python that runs ``unit`` and ``lint``; its base also gets :data:`LINT_TOOLS`.
TOOLS_PYTHON = "3.11"
LINT_TOOLS = ("ruff==0.17.6",)
#: Distributions whose versions are checked against each release's limits.
LIMITED_DISTS = ("torch", "numpy", "setuptools")
#: pytest's exit status when it collected no test: the session fails (and counts as an error in the matrix).
PYTEST_NO_TESTS = 5

nox.needs_version = ">=2025.2.9"
nox.options.sessions = ["unit", "lint"]


def _load_support() -> ModuleType:
    """The package ``mcore_compat/support/`` loaded from its source files under a name of its own (nox's
    interpreter lacks mcore_compat's deps; the package imports nothing else of mcore_compat)."""
    name = "_mcore_compat_support_for_nox"
    if name in sys.modules:
        return sys.modules[name]
    package = REPO / "mcore_compat" / "support"
    spec = importlib.util.spec_from_file_location(name, package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


support = _load_support()
MATRIX = support.Matrix(REPO / "matrix", results_dir=REPO / "matrix")
RELEASES = MATRIX.releases()


# ============================================================================================ output and commands
class _Out:
    """Where one job's output goes: the console (``log=None``) or a log file."""

    _print_lock = threading.Lock()

    def __init__(self, log: Path | None = None) -> None:
        self.log = log
        self._fh: IO[str] | None = None
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            self._fh = log.open("w", encoding="utf-8")

    def say(self, text: str) -> None:
        """One line to the job's output."""
        if self._fh is not None:
            self._fh.write(text + "\n")
            self._fh.flush()
        else:
            _console(text)

    def run(self, argv: Sequence[str | Path], env: dict[str, str] | None = None, check: bool = True,
            cwd: Path = REPO) -> int:
        """Run a command, its output going to the job's output; raise :class:`_JobError` if ``check`` fails."""
        args = [str(a) for a in argv]
        self.say("$ " + " ".join("<script>" if "\n" in a else a for a in args))
        if self._fh is not None:
            self._fh.flush()
        proc = subprocess.run(args, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=self._fh,
                              stderr=subprocess.STDOUT if self._fh is not None else None, check=False)
        if check and proc.returncode != 0:
            raise _JobError(f"command failed with exit status {proc.returncode}: {' '.join(args)}")
        return proc.returncode

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _console(text: str) -> None:
    with _Out._print_lock:
        print(text, flush=True)


class _JobError(RuntimeError):
    """A preparation step or check failed (the message says which and why)."""


@contextlib.contextmanager
def _file_lock(name: str, out: _Out) -> Iterator[None]:
    """An exclusive lock shared by every process and thread (``flock`` on ``.cache/locks/<name>.lock``)."""
    LOCKS.mkdir(parents=True, exist_ok=True)
    with (LOCKS / f"{name}.lock").open("w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            out.say(f"waiting for the lock {name} (another session is preparing it)")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:20]


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8").strip() if path.is_file() else ""


# ============================================================================================ interpreters
_FOUND_PYTHONS: dict[str, str] = {}


def _interpreter_candidates(python: str) -> list[str]:
    override = os.environ.get(f"MCORE_COMPAT_PYTHON_{python.replace('.', '_')}")
    pyenv = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    found = [override, shutil.which(f"python{python}")]
    found += sorted(glob.glob(f"{pyenv}/versions/{python}.*/bin/python{python}"), reverse=True)
    found += [f"/usr/local/bin/python{python}", f"/usr/bin/python{python}"]
    return [c for c in dict.fromkeys(found) if c]


def _find_python(python: str) -> str:
    """An interpreter of ``python`` (``"3.12"``) that runs and can make venvs (pyenv shims that fail are skipped)."""
    if python in _FOUND_PYTHONS:
        return _FOUND_PYTHONS[python]
    probe = "import sys, venv, ensurepip; print('%d.%d' % sys.version_info[:2])"
    for cand in _interpreter_candidates(python):
        try:
            proc = subprocess.run([cand, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if proc.returncode == 0 and proc.stdout.strip() == python:
            _FOUND_PYTHONS[python] = cand
            return cand
    raise _JobError(f"no working Python {python} interpreter with venv/ensurepip found (tried "
                    f"{', '.join(_interpreter_candidates(python))}); set MCORE_COMPAT_PYTHON_{python.replace('.', '_')}")


# ============================================================================================ base environments
def _pytag(python: str) -> str:
    return "py" + python.replace(".", "")


def base_dir(python: str) -> Path:
    """``.cache/base-py311``."""
    return CACHE / f"base-{_pytag(python)}"


def base_python(python: str) -> Path:
    """The base venv's interpreter."""
    return base_dir(python) / "bin" / "python"


def base_requirements(python: str) -> list[str]:
    """What the base of ``python`` gets: versions.toml's requirements plus the test (and lint) tools."""
    extra = list(TEST_TOOLS) + (list(LINT_TOOLS) if python == TOOLS_PYTHON else [])
    return MATRIX.base_requirements(python) + extra


_UNMET_SCRIPT = r"""
import importlib.metadata as md, json, sys
from packaging.requirements import Requirement
bad = []
for text in json.loads(sys.argv[1]):
    req = Requirement(text)
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        bad.append(text + " (missing)")
        continue
    if not req.specifier.contains(have, prereleases=True):
        bad.append(f"{text} (have {have})")
print(json.dumps(bad))
"""


def _unmet(python: str, requirements: list[str]) -> list[str] | None:
    """Requirements the base does not satisfy (``None``: the base is missing or broken)."""
    exe = base_python(python)
    if not exe.exists():
        return None
    proc = subprocess.run([str(exe), "-I", "-c", _UNMET_SCRIPT, json.dumps(requirements)], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        return None
    return list(json.loads(proc.stdout))


def ensure_base(python: str, out: _Out) -> Path:
    """Build (once) the shared base venv of ``python``; returns its interpreter."""
    reqs = base_requirements(python)
    stamp_value = _digest({"python": python, "requirements": reqs})
    stamp = base_dir(python) / ".mcore-compat-stamp"
    with _file_lock(f"base-{_pytag(python)}", out):
        if _read(stamp) == stamp_value and base_python(python).exists():
            return base_python(python)
        start = time.monotonic()
        unmet = None if os.environ.get("MCORE_COMPAT_REBUILD_BASE") == "1" else _unmet(python, reqs)
        if unmet is None:
            out.say(f"building the base environment {base_dir(python)} (Python {python})")
            shutil.rmtree(base_dir(python), ignore_errors=True)
            out.run([_find_python(python), "-m", "venv", base_dir(python)])
        if unmet is None or unmet:
            out.say(f"installing into {base_dir(python)}: {' '.join(reqs)}" + (f" (unmet: {unmet})" if unmet else ""))
            out.run([base_python(python), "-m", "pip", "install", *reqs])
        still = _unmet(python, reqs)
        if still:
            raise _JobError(f"the base {base_dir(python)} still does not satisfy {still}")
        stamp.write_text(stamp_value + "\n", encoding="utf-8")
        out.say(f"base {base_dir(python)} ready in {time.monotonic() - start:.1f}s")
    return base_python(python)


_VERSIONS_SCRIPT = r"""
import importlib.metadata as md, json, platform, sys
have = {}
for name in json.loads(sys.argv[1]):
    try:
        have[name] = md.version(name)
    except md.PackageNotFoundError:
        have[name] = None
print(json.dumps({"python": platform.python_version(), "dists": have}))
"""


def check_limits(release: Any, out: _Out) -> None:
    """Fail unless the release's limits (python, torch, numpy, setuptools) hold in its base."""
    proc = subprocess.run([str(base_python(release.python)), "-I", "-c", _VERSIONS_SCRIPT,
                           json.dumps(list(LIMITED_DISTS))], capture_output=True, text=True, check=True)
    found = json.loads(proc.stdout)
    problems = release.unmet_limits(found["python"], found["dists"])
    if problems:
        raise _JobError(f"megatron-core {release.version}: the base {base_dir(release.python)} breaks the "
                        f"release's limits from matrix/versions.toml: {'; '.join(problems)}. Fix "
                        f'[base."{release.python}"] or the release entry.')
    out.say(f"limits of {release.version} hold: python {found['python']}, "
            + ", ".join(f"{k} {v}" for k, v in found["dists"].items()))


# ============================================================================================ mcore-compat itself
def _package_sources() -> list[Path]:
    """The files and directories a wheel of this repository is built from."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    dirs = set(pyproject.get("tool", {}).get("setuptools", {}).get("package-dir", {}).values()) | {"mcore_compat"}
    files = [REPO / "pyproject.toml", *sorted(REPO.glob("README*")), *sorted(REPO.glob("LICENSE*"))]
    return files + [REPO / d for d in sorted(dirs)]


def _iter_source_files() -> Iterator[Path]:
    for src in _package_sources():
        if src.is_file():
            yield src
        elif src.is_dir():
            yield from sorted(p for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                              and not p.name.endswith(".pyc"))


@functools.cache
def _sources_digest() -> str:
    """A hash of the package's files, taken once per nox run (both Pythons then install the same wheel)."""
    h = hashlib.sha256()
    for path in _iter_source_files():
        h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:20]


def mcc_dir(python: str) -> Path:
    """``.cache/mcc/py311``: the installed mcore-compat for ``python``."""
    return MCC_ROOT / _pytag(python)


_MCC_DONE: dict[str, str] = {}


def ensure_mcc(python: str, out: _Out) -> Path:
    """Install this repository (non-editable) into ``.cache/mcc/py3xx``.

    Once per nox run and Python: later sessions of the same run reuse it even if the sources change meanwhile
    (so every session of a matrix tests the same code). Across runs it is reinstalled when the files changed.
    """
    target = mcc_dir(python)
    with _file_lock(f"mcc-{_pytag(python)}", out):
        if python in _MCC_DONE and target.is_dir():
            return target
        digest = _sources_digest()
        stamp = MCC_ROOT / f"{_pytag(python)}.stamp"
        if _read(stamp) != digest or not target.is_dir():
            wheel = _build_mcc_wheel(python, digest, out)
            tmp = target.with_name(target.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            out.run([base_python(python), "-m", "pip", "install", "--no-deps", "--no-compile", "--target", tmp,
                     wheel])
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
            stamp.write_text(digest + "\n", encoding="utf-8")
        _MCC_DONE[python] = digest
    return target


def _build_mcc_wheel(python: str, digest: str, out: _Out) -> Path:
    """A wheel of this repository for ``digest``, built from a clean copy (the source tree is left untouched)."""
    dist = MCC_ROOT / "dist" / digest
    with _file_lock("mcc-wheel", out):
        found = sorted(dist.glob("mcore_compat-*.whl"))
        if found:
            return found[0]
        src = MCC_ROOT / "src"
        shutil.rmtree(src, ignore_errors=True)
        for path in _iter_source_files():
            dest = src / path.relative_to(REPO)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
        shutil.rmtree(MCC_ROOT / "dist", ignore_errors=True)
        out.run([base_python(python), "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", dist, src])
        found = sorted(dist.glob("mcore_compat-*.whl"))
        if not found:
            raise _JobError(f"building the mcore-compat wheel left nothing in {dist}")
        return found[0]


# ============================================================================================ megatron-core
def _wheel_python(release: Any) -> str:
    return release.wheel_python if release.install == "unpack-wheel" else release.python


def _wheel_fits(path: Path, python: str) -> bool:
    """Whether a wheel file name's python tag fits ``python`` (``cp311`` / ``py3``)."""
    tag = path.name[:-4].split("-")[-3]
    return any(t in (f"cp{python.replace('.', '')}", "py3", f"py{python.replace('.', '')}") for t in tag.split("."))


def ensure_wheel(release: Any, out: _Out) -> Path:
    """The release's wheel in ``.cache/wheels`` (downloaded from PyPI once)."""
    python = _wheel_python(release)
    pattern = f"megatron_core-{release.version}-*.whl"

    def _cached() -> Path | None:
        return next((p for p in sorted(WHEELS.glob(pattern)) if _wheel_fits(p, python)), None)

    if (found := _cached()) is not None:
        return found
    with _file_lock(f"wheel-{release.version}", out):
        if (found := _cached()) is not None:
            return found
        WHEELS.mkdir(parents=True, exist_ok=True)
        out.run([base_python(release.python), "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                 "--python-version", python, "-d", WHEELS, f"megatron-core=={release.version}"])
        if (found := _cached()) is None:
            raise _JobError(f"pip download left no {pattern} for Python {python} in {WHEELS}")
        return found


def mc_dir(release: Any) -> Path:
    """``.cache/mc/<V>``: the directory put first on ``PYTHONPATH`` for a release."""
    return MC_ROOT / str(release.version)


def ensure_mc(release: Any, out: _Out) -> Path:
    """Install (once) the release into ``.cache/mc/<V>``."""
    wheel = ensure_wheel(release, out)
    target = mc_dir(release)
    stamp = MC_ROOT / f"{release.version}.stamp"
    stamp_value = _digest({"wheel": wheel.name, "install": release.install})
    with _file_lock(f"mc-{release.version}", out):
        if _read(stamp) == stamp_value and target.is_dir():
            return target
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        if release.install == "unpack-wheel":
            _unpack_megatron_tree(wheel, tmp, out)
        else:
            out.run([base_python(release.python), "-m", "pip", "install", "--no-deps", "--no-compile", "--target",
                     tmp, wheel])
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        stamp.write_text(stamp_value + "\n", encoding="utf-8")
    return target


def _unpack_megatron_tree(wheel: Path, dest: Path, out: _Out) -> None:
    """Unzip only the wheel's ``megatron/`` tree (no ``*.dist-info``): a source checkout on ``sys.path``."""
    out.say(f"unpacking the megatron/ tree of {wheel.name} into {dest} (no metadata)")
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.startswith("megatron/")]
        if not members:
            raise _JobError(f"{wheel.name} has no megatron/ tree")
        zf.extractall(dest, members)


# ============================================================================================ running a release
_STARTUP_CHECK = r"""
import importlib.metadata as md, importlib.util, json, os, platform, sys
from pathlib import Path

want, mc_dir, mcc_dir, report_path = sys.argv[1], Path(sys.argv[2]).resolve(), Path(sys.argv[3]).resolve(), sys.argv[4]

def inside(path, root):
    path = Path(path).resolve()
    return path == root or root in path.parents

def dist_version(*names):
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            pass
    return None

import mcore_compat
assert inside(mcore_compat.__file__, mcc_dir), f"mcore_compat was imported from {mcore_compat.__file__}, not from the installed copy in {mcc_dir}"
info = mcore_compat.detect()
assert str(info.version) == want, f"mcore_compat.detect() reports megatron-core {info.version}, the session wants {want}: {info.describe()}"
assert inside(info.path, mc_dir), f"mcore_compat.detect() found megatron.core in {info.path}, not in {mc_dir}"
import torch
# 0.15.x JIT-builds a CUDA extension on import unless this is set (mcore_compat's patches handle it in the tests).
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
import megatron.core
assert inside(megatron.core.__file__, mc_dir), f"megatron.core was imported from {megatron.core.__file__}, not from {mc_dir}"
report = {
    "python": platform.python_version(),
    "executable": sys.executable,
    "torch": torch.__version__,
    "megatron_core": str(info.version),
    "megatron_source": info.source,
    "megatron_path": str(info.path),
    "megatron_checkout": info.checkout,
    "mcore_compat": getattr(mcore_compat, "__version__", "?"),
    "mcore_compat_path": str(Path(mcore_compat.__file__).parent),
    "apex": dist_version("apex") or ("present" if importlib.util.find_spec("apex") else None),
    "transformer_engine": dist_version("transformer-engine", "transformer_engine")
        or ("present" if importlib.util.find_spec("transformer_engine") else None),
    "numpy": dist_version("numpy"),
    "setuptools": dist_version("setuptools"),
}
for key, value in report.items():
    print(f"  {key:<18} {value}")
with open(report_path, "w") as fh:
    json.dump(report, fh, indent=2)
print(f"start-up check OK: megatron-core {want} from {mc_dir}, mcore_compat from {mcc_dir}")
"""


def session_env(python: str, release: Any | None = None) -> dict[str, str]:
    """The environment of a test run: ``PYTHONPATH`` = the release's dir and the installed mcore-compat."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "VIRTUAL_ENV", "MCORE_COMPAT_VERSION")}
    paths = ([str(mc_dir(release))] if release is not None else []) + [str(mcc_dir(python))]
    env.update(PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1", PYTHONNOUSERSITE="1",
               PATH=os.pathsep.join([str(base_python(python).parent), env.get("PATH", "")]))
    return env


@dataclass
class JobResult:
    """The outcome of one session run by :func:`matrix` (or a single session)."""

    name: str
    ok: bool = False
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0
    seconds: float = 0.0
    details: str = ""
    report: dict[str, Any] = field(default_factory=dict)
    log: Path | None = None
    ran_pytest: bool = False
    selfcheck: dict[str, Any] = field(default_factory=dict)
    faults: dict[str, Any] = field(default_factory=dict)


def _junit_counts(path: Path, result: JobResult) -> None:
    """Add a pytest ``--junitxml`` file's counts (and failed test ids) to ``result``."""
    if not path.is_file():
        return
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    bad: list[str] = []
    for suite in suites:
        tests, fails, errs, skips = (int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped"))
        result.failed += fails
        result.errors += errs
        result.skipped += skips
        result.passed += tests - fails - errs - skips
        for case in suite.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                bad.append(f"{case.get('classname', '')}::{case.get('name', '')}")
    if bad:
        shown = ", ".join(bad[:20]) + (f" (+{len(bad) - 20} more)" if len(bad) > 20 else "")
        result.details = f"failed: {shown}"


def _run_pytest(python: str, release: Any | None, marker: str, name: str, out: _Out, result: JobResult,
                extra: Sequence[str]) -> None:
    LOGS.mkdir(parents=True, exist_ok=True)
    junit = LOGS / f"{name}.junit.xml"
    junit.unlink(missing_ok=True)
    argv = [base_python(python), "-P", "-m", "pytest", *TEST_PATHS, "-m", marker, "-p", "no:cacheprovider",
            f"--junitxml={junit}", *extra]
    env = session_env(python, release)
    faults = LOGS / f"{name}.faults.json"
    faults.unlink(missing_ok=True)
    env["MCORE_COMPAT_FAULT_REPORT"] = str(faults)  # the fault-injection suite writes its score there
    code = out.run(argv, env=env, check=False)
    result.ran_pytest = True
    _junit_counts(junit, result)
    if faults.is_file():
        score = json.loads(faults.read_text(encoding="utf-8"))
        result.faults = {k: score[k] for k in ("caught", "faults", "clean_pass", "clean")}
    if code == PYTEST_NO_TESTS:  # a session that tested nothing proves nothing: a wrong path, marker or -k
        out.say(f"ERROR: pytest collected no test (exit status {code}); a session must run tests")
        result.details = result.details or f"pytest collected no test (exit status {code})"
    elif code != 0:
        result.details = result.details or f"pytest exited with status {code}"
    if code != 0 and not (result.failed or result.errors):
        result.errors += 1
    result.ok = code == 0


def run_release(release: Any, out: _Out, extra: Sequence[str] = ()) -> JobResult:
    """Prepare and run one release: base, limits, wheel, ``.cache/mc/<V>``, mcore-compat, start-up check, pytest."""
    result = JobResult(name=release.session, log=out.log)
    start = time.monotonic()
    try:
        ensure_base(release.python, out)
        check_limits(release, out)
        ensure_mc(release, out)
        ensure_mcc(release.python, out)
        LOGS.mkdir(parents=True, exist_ok=True)
        report_path = LOGS / f"{release.session}.startup.json"
        report_path.unlink(missing_ok=True)
        out.say(f"start-up check of megatron-core {release.version} on Python {release.python}")
        code = out.run([base_python(release.python), "-P", "-c", _STARTUP_CHECK, str(release.version),
                        mc_dir(release), mcc_dir(release.python), report_path],
                       env=session_env(release.python, release), check=False)
        if code != 0:
            raise _JobError(f"start-up check failed (exit status {code}); see its output above")
        result.report = json.loads(report_path.read_text(encoding="utf-8"))
        _run_pytest(release.python, release, "mcore", release.session, out, result, extra)
        if not extra:  # a narrowed run (``-- -k ...``) skips the CLI self-check
            _run_selfcheck(release, out, result)
    except (_JobError, subprocess.CalledProcessError, OSError) as exc:
        out.say(f"ERROR: {exc}")
        result.ok, result.details = False, str(exc)
        result.errors += 0 if result.ran_pytest else 1
    result.seconds = time.monotonic() - start
    return result


#: What every release session runs after pytest: the main job, as a user runs it.
SELFCHECK_ARGS = ("self-check", "--nproc", "2", "--sweep", "--device", "cpu", "--bind", "--timeout", "600")


def _run_selfcheck(release: Any, out: _Out, result: JobResult) -> None:
    """``mcore-compat self-check --nproc 2 --sweep --bind`` (DP=2 and TP=2 with the distributed optimizer on and
    off, PP=2): its verdict joins the session's, its per-configuration summaries go into the recorded result."""
    path = LOGS / f"{release.session}.selfcheck.json"
    path.unlink(missing_ok=True)
    out.say("mcore-compat " + " ".join(SELFCHECK_ARGS))
    code = out.run([base_python(release.python), "-P", "-m", "mcore_compat", *SELFCHECK_ARGS, "--json", path],
                   env=session_env(release.python, release), check=False)
    reports = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []
    configs = [{**{k: r["settings"].get(k) for k in ("tp", "pp", "dp", "vpp", "sequence_parallel", "tie_embeddings",
                                                     "overlap", "experts", "ep", "distributed_optimizer", "bind",
                                                     "dtype")},
                "summary": r["summary"]} for r in reports]
    good = sum(bool(r["ok"]) for r in reports)
    result.selfcheck = {"result": "pass" if code == 0 else "fail", "configurations": configs,
                        "summary": f"{good}/{len(reports)} configurations pass"}
    if code != 0:
        result.ok = False
        result.errors += 1
        result.details = "; ".join(filter(None, [result.details, f"self-check exited with status {code}"]))


def run_unit(out: _Out, extra: Sequence[str] = ()) -> JobResult:
    """The tests that need no megatron-core, against the installed mcore-compat."""
    result = JobResult(name="unit", log=out.log)
    start = time.monotonic()
    try:
        ensure_base(TOOLS_PYTHON, out)
        ensure_mcc(TOOLS_PYTHON, out)
        _run_pytest(TOOLS_PYTHON, None, "not mcore", "unit", out, result, extra)
    except (_JobError, subprocess.CalledProcessError, OSError) as exc:
        out.say(f"ERROR: {exc}")
        result.ok, result.details, result.errors = False, str(exc), result.errors + 1
    result.seconds = time.monotonic() - start
    return result


def run_lint(out: _Out, extra: Sequence[str] = ()) -> JobResult:
    """``ruff check .`` with the ruff of the tools base."""
    result = JobResult(name="lint", log=out.log)
    start = time.monotonic()
    try:
        ensure_base(TOOLS_PYTHON, out)
        code = out.run([base_python(TOOLS_PYTHON), "-m", "ruff", "check", ".", *extra], check=False)
        result.ok = code == 0
        if not result.ok:
            result.details, result.errors = f"ruff check exited with status {code}", 1
    except (_JobError, subprocess.CalledProcessError, OSError) as exc:
        out.say(f"ERROR: {exc}")
        result.ok, result.details, result.errors = False, str(exc), 1
    result.seconds = time.monotonic() - start
    return result


# ============================================================================================ single sessions
def _finish(session: nox.Session, result: JobResult) -> None:
    if not result.ok:
        session.error(f"{result.name} failed: {result.details}")
    session.log(f"{result.name}: {_counts_text(result)} in {result.seconds:.1f}s")


@nox.session(venv_backend="none", tags=["cpu"])
def unit(session: nox.Session) -> None:
    """Tests that need no megatron-core (pytest -m "not mcore"), against the installed mcore-compat."""
    _finish(session, run_unit(_Out(), session.posargs))


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff check ."""
    _finish(session, run_lint(_Out(), session.posargs))


def _make_release_session(release: Any) -> None:
    def _session(session: nox.Session) -> None:
        _finish(session, run_release(release, _Out(), session.posargs))

    _session.__doc__ = f"megatron-core {release.version} on Python {release.python}"
    _session.__name__ = _session.__qualname__ = release.session.replace("-", "_").replace(".", "_")
    nox.session(_session, name=release.session, venv_backend="none", tags=list(release.tags), default=False)


for _release in RELEASES:
    _make_release_session(_release)


# ============================================================================================ the matrix
@dataclass
class _MatrixOptions:
    jobs: int = 2
    tag: str | None = None
    record: bool = True


def _parse_matrix_args(args: Sequence[str]) -> _MatrixOptions:
    opts = _MatrixOptions()
    it = iter(args)
    for arg in it:
        if arg == "--jobs":
            opts.jobs = max(1, int(next(it)))
        elif arg == "--tag":
            opts.tag = next(it)
        elif arg == "--no-record":
            opts.record = False
        else:
            raise _JobError(f"unknown matrix option {arg!r} (have --jobs N, --tag TAG, --no-record)")
    return opts


def _counts_text(result: JobResult) -> str:
    parts = [f"{n} {w}" for n, w in ((result.failed, "failed"), (result.passed, "passed"),
                                     (result.skipped, "skipped")) if n]
    if result.errors:
        parts.append(f"{result.errors} error" + ("s" if result.errors != 1 else ""))
    return ", ".join(parts) or ("ok" if result.ok else "failed")


def _summary_line(results: Sequence[JobResult], seconds: float) -> str:
    total = JobResult(name="total")
    for r in results:
        total.passed += r.passed
        total.failed += r.failed
        total.skipped += r.skipped
        total.errors += r.errors
    parts = [f"{n} {w}" for n, w in ((total.failed, "failed"), (total.passed, "passed"), (total.skipped, "skipped"))
             if n]
    if total.errors:
        parts.append(f"{total.errors} error" + ("s" if total.errors != 1 else ""))
    return f"==== {', '.join(parts) or 'no tests ran'} in {seconds:.2f}s ===="


def _tail(path: Path | None, lines: int = 40) -> str:
    if path is None or not path.is_file():
        return ""
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


def _cpu_record(release: Any, result: JobResult) -> dict[str, Any]:
    rep = result.report
    return {
        "result": "pass" if result.ok else "fail",
        "python": rep.get("python"),
        "torch": rep.get("torch"),
        "passed": result.passed,
        "failed": result.failed,
        "skipped": result.skipped,
        "errors": result.errors,
        "seconds": round(result.seconds, 1),
        "install": release.install,
        "details": result.details,
        "self_check": result.selfcheck or None,
        "fault_detection": result.faults or None,
    }


def _start_bases(pool: cf.ThreadPoolExecutor, pythons: Sequence[str]) -> dict[str, cf.Future[Path]]:
    """Build every needed base at once in the background (3.12's torch is a large download: overlap it)."""
    return {py: pool.submit(ensure_base, py, _Out(LOGS / f"base-{_pytag(py)}.log")) for py in pythons}


def _job(name: str, base: cf.Future[Path], body: Callable[[_Out], JobResult]) -> JobResult:
    out = _Out(LOGS / f"{name}.log")
    try:
        try:
            base.result()
        except Exception as exc:  # the base failed: every job on it fails with that reason
            return JobResult(name=name, errors=1, details=f"base environment failed: {exc}", log=out.log)
        return body(out)
    finally:
        out.close()


@nox.session(venv_backend="none", default=False)
def matrix(session: nox.Session) -> None:
    """unit + lint + every release session, 2 at a time; records CPU results and regenerates matrix/README.md."""
    started = time.monotonic()
    opts = _parse_matrix_args(session.posargs)
    LOGS.mkdir(parents=True, exist_ok=True)
    SUMMARY_FILE.unlink(missing_ok=True)
    releases = [r for r in RELEASES if opts.tag is None or opts.tag in r.tags]
    pythons = sorted({TOOLS_PYTHON, *(r.python for r in releases)})
    session.log(f"matrix: unit, lint and {len(releases)} releases on Python {', '.join(pythons)}, "
                f"{opts.jobs} at a time; logs in {LOGS}")
    with cf.ThreadPoolExecutor(len(pythons)) as base_pool, cf.ThreadPoolExecutor(opts.jobs) as pool:
        bases = _start_bases(base_pool, pythons)
        futures = {pool.submit(_job, "unit", bases[TOOLS_PYTHON], run_unit): "unit",
                   pool.submit(_job, "lint", bases[TOOLS_PYTHON], run_lint): "lint"}
        for rel in releases:
            futures[pool.submit(_job, rel.session, bases[rel.python],
                                lambda o, r=rel: run_release(r, o))] = rel.session
        results = _collect(futures)
    by_name = {r.name: r for r in results}
    if opts.record:
        for rel in releases:
            MATRIX.record_result(rel.version, "cpu", _cpu_record(rel, by_name[rel.session]))
    readme = MATRIX.write_readme()
    session.log(f"regenerated {readme.relative_to(REPO)}" + (" and recorded CPU results" if opts.record else ""))
    failed = _report(results, started)
    if failed:
        session.error(f"{len(failed)} session(s) failed: {', '.join(failed)}")


def _collect(futures: dict[cf.Future[JobResult], str]) -> list[JobResult]:
    results: list[JobResult] = []
    for n, fut in enumerate(cf.as_completed(futures), 1):
        res = fut.result()
        results.append(res)
        mark = "ok  " if res.ok else "FAIL"
        _console(f"[{n:>2}/{len(futures)}] {mark} {res.name:<14} {_counts_text(res):<40} {res.seconds:7.1f}s")
        if not res.ok:
            _console(f"      {res.details}\n      --- last lines of {res.log} ---\n{_tail(res.log)}\n      ---")
    order = list(futures.values())
    return sorted(results, key=lambda r: order.index(r.name))


def _report(results: Sequence[JobResult], started: float) -> list[str]:
    """Print timings, the failed sessions and the summary line (also written to SUMMARY_FILE); returns the failed."""
    failed = [r for r in results if not r.ok]
    _console("")
    _console("session timings: " + ", ".join(f"{r.name} {r.seconds:.0f}s" for r in results))
    if failed:
        _console(f"FAILED sessions ({len(failed)}): " + ", ".join(r.name for r in failed))
        for r in failed:
            _console(f"  {r.name}: {r.details} (log: {r.log})")
    line = _summary_line(results, time.monotonic() - started)
    SUMMARY_FILE.write_text(line + "\n", encoding="utf-8")
    _console(line)
    return [r.name for r in failed]
