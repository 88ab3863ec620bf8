"""What a release needs of this machine, before anything is installed: ``mcore-compat doctor --for V``.

For a listed release V (``matrix/versions.toml``) the plan says which Python it runs on, whether the running
interpreter is one, where an interpreter that is one was found when it is not (on ``PATH``, under pyenv, or through
uv - a Python that is installed but not on ``PATH`` is the usual case), and the exact commands: into the running
environment when it fits, else a new virtual environment on the interpreter found. Without a GPU the commands
take PyTorch's CPU build (PyTorch's own CPU package index), which is a fraction of the CUDA build's size (this
project's Python 3.12 venv with the CUDA build: 4.7 GB; its Python 3.11 venv with the CPU build: 1.1 GB).
"""

from __future__ import annotations

import glob
import os
import platform
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .fit import Fit, fit
from .model import Release

__all__ = ["CPU_TORCH_INDEX", "Interpreter", "Plan", "find_interpreter", "plan_for"]

#: PyTorch's package index of CPU-only builds.
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


@dataclass(frozen=True)
class Interpreter:
    """A Python interpreter found on this machine.

    Attributes:
        path: its executable.
        version: its full version (``"3.12.1"``).
        found_by: ``"PATH"``, ``"pyenv"``, ``"uv"`` or ``"running"`` (the interpreter running doctor).
    """

    path: str
    version: str
    found_by: str


@dataclass(frozen=True)
class Plan:
    """How to run release ``release`` here (see :func:`plan_for`).

    Attributes:
        release: the listed release.
        python_minor: the Python the matrix tests it on (``"3.12"``).
        running: the interpreter running doctor.
        interpreter: the interpreter the commands use (``None``: none found that the release accepts).
        fit: the running environment against the release's limits (``None`` when the running Python is not one
            the release runs on: the commands then make a new environment).
        commands: shell commands to run, in order.
        notes: one-line remarks (why a new environment, the CPU build, how to get a missing Python).
    """

    release: Release
    python_minor: str
    running: Interpreter
    interpreter: Interpreter | None
    fit: Fit | None
    commands: tuple[str, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        """An interpreter for the release is on this machine (the commands can run as printed)."""
        return self.interpreter is not None


#: Printed under a command that installs torch from :data:`CPU_TORCH_INDEX` (``doctor --for``): what to do when
#: pip answers ``ResolutionImpossible`` or finds no matching distribution because the index is unreachable.
CPU_INDEX_FALLBACK = ("if pip cannot reach that index (ResolutionImpossible, no matching distribution): run the "
                      "same command without --index-url (pip then takes the CUDA build from PyPI, which also runs on "
                      "a CPU)")
_CPU_NOTE = ("no GPU here: torch's CPU build from PyTorch's CPU index (this project's 3.11 venv with it: 1.1 GB; its "
             "3.12 venv with the CUDA build: 4.7 GB); where that index cannot be reached, drop --index-url and pip "
             "takes the CUDA build")


def _accepts(release: Release, version: str) -> bool:
    """Whether the release runs on Python ``version``: its tested minor, within what it declares."""
    minor = ".".join(version.split(".")[:2])
    if minor != release.python:
        return False
    try:
        return not release.requires_python or SpecifierSet(release.requires_python).contains(Version(version))
    except InvalidVersion:
        return False


def _version_of(exe: str) -> str | None:
    try:
        proc = subprocess.run([exe, "-c", "import platform; print(platform.python_version())"], capture_output=True,
                              text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    out = proc.stdout.strip()
    return out if proc.returncode == 0 and out else None


def _candidates(minor: str) -> list[tuple[str, str]]:
    """``(path, found_by)`` of interpreters that may be Python ``minor``: on PATH, under pyenv, through uv."""
    found: list[tuple[str, str]] = []
    on_path = shutil.which(f"python{minor}")
    if on_path:
        found.append((on_path, "PATH"))
    root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    for exe in sorted(glob.glob(os.path.join(root, "versions", f"{minor}.*", "bin", f"python{minor}")), reverse=True):
        found.append((exe, "pyenv"))
    uv = shutil.which("uv")
    if uv:
        try:
            proc = subprocess.run([uv, "python", "find", minor], capture_output=True, text=True, timeout=20)
            if proc.returncode == 0 and proc.stdout.strip():
                found.append((proc.stdout.strip(), "uv"))
        except (OSError, subprocess.SubprocessError):
            pass
    return found


def find_interpreter(release: Release, *,
                     candidates: Callable[[str], Sequence[tuple[str, str]]] = _candidates,
                     version_of: Callable[[str], str | None] = _version_of) -> Interpreter | None:
    """An interpreter on this machine that ``release`` runs on (``None``: none found)."""
    for path, how in candidates(release.python):
        version = version_of(path)
        if version and _accepts(release, version):
            return Interpreter(path, version, how)
    return None


def _project_requirement() -> str:
    """What ``pip install`` takes for mcore-compat: this checkout when running from one, else the release."""
    from .._version import __version__

    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "mcore_compat").is_dir():
        return str(root)
    source = _installed_from()
    return str(source) if source is not None else f"mcore-compat=={__version__}"


def _installed_from() -> Path | None:
    """The checkout this installed mcore-compat was built from (``pip install .``: pip records it in the
    distribution's ``direct_url.json``, PEP 610), if it is still there; ``None`` otherwise."""
    import json
    from importlib import metadata
    from urllib.parse import unquote, urlparse

    try:
        text = metadata.distribution("mcore-compat").read_text("direct_url.json")
        url = urlparse(json.loads(text)["url"]) if text else None
    except (metadata.PackageNotFoundError, ValueError, KeyError, TypeError):
        return None
    if url is None or url.scheme != "file":
        return None
    path = Path(unquote(url.path))
    return path if (path / "pyproject.toml").is_file() else None


def _has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None or Path("/dev/nvidia0").exists()


def _megatron_install(release: Release, python: str, limits: Sequence[str]) -> list[str]:
    """The commands that put ``release`` into the environment of ``python`` (quoted): ``pip install`` of the wheel,
    or, for a release whose only wheel is for another Python (``install = "unpack-wheel"``: 0.4.0's cp310 wheel; its
    sdist does not build), the wheel's ``megatron/`` tree unzipped into that environment's site-packages."""
    pip = f"{python} -m pip"
    if release.install != "unpack-wheel":
        reqs = [f"megatron-core=={release.version}", *limits]
        return [f"{pip} install {' '.join(shlex.quote(r) for r in reqs)}"]
    where = f"/tmp/megatron-core-{release.version}"
    unzip = ("import glob, sysconfig, zipfile; "
             f'z = zipfile.ZipFile(glob.glob("{where}/*.whl")[0]); '
             '[z.extract(n, sysconfig.get_paths()["purelib"]) for n in z.namelist() if n.startswith("megatron/")]')
    out = [f"{pip} download --no-deps --only-binary=:all: --python-version {release.wheel_python} "
           f"-d {where} megatron-core=={release.version}", f"{python} -c {shlex.quote(unzip)}"]
    if limits:
        out.append(f"{pip} install {' '.join(shlex.quote(r) for r in limits)}")
    return out


def plan_for(release: Release, releases: Sequence[Release], base_requirements: Sequence[str], *,
             gpu: bool | None = None, running: Interpreter | None = None,
             interpreter: Callable[[Release], Interpreter | None] = find_interpreter,
             venv: str | None = None) -> Plan:
    """The plan for ``release`` on this machine.

    Args:
        release: the release wanted.
        releases: every listed release (to name the newest one for the running Python).
        base_requirements: what the matrix installs next to it on its Python (torch, numpy, ... pins).
        gpu: whether a GPU is present (default: ``nvidia-smi`` on PATH or ``/dev/nvidia0``).
        running: the running interpreter (default: this one).
        interpreter: finds an interpreter for a release (default: :func:`find_interpreter`).
        venv: the directory of a new environment (default: ``.venv<python without the dot>``, e.g. ``.venv312``,
            the name README.md uses).
    """
    gpu = _has_gpu() if gpu is None else gpu
    here = running or Interpreter(sys.executable, platform.python_version(), "running")
    torch_req = [r for r in base_requirements if r.split("=")[0].split("<")[0].split(">")[0].strip() == "torch"]
    limits = [f"{name}{spec}" for name, spec in release.limits().items() if name in ("numpy", "setuptools")]
    notes: list[str] = []
    if _accepts(release, here.version):
        use, env_fit = here, fit(release, releases=releases, python=here.version, python_exe=here.path)
        commands = _megatron_install(release, shlex.quote(here.path), limits)
        if env_fit.installed.get("torch") is None and torch_req:
            commands.insert(0, f"{shlex.quote(here.path)} -m pip install {shlex.quote(torch_req[0])}"
                               + ("" if gpu else f" --index-url {CPU_TORCH_INDEX}"))
            if not gpu:
                notes.append(_CPU_NOTE)
        notes.append(f"the running Python {here.version} runs megatron-core {release.version}: install into this "
                     f"environment")
        return Plan(release, release.python, here, use, env_fit, tuple(commands), tuple(notes))
    found = interpreter(release)
    notes.append(f"megatron-core {release.version} runs on Python {release.python} (declares "
                 f"{release.requires_python or 'no limit'}); the running Python is {here.version}: a new environment")
    if found is None:
        notes.append(f"no Python {release.python} found on PATH, under pyenv or through uv: install one (e.g. "
                     f"`uv python install {release.python}` or `pyenv install {release.python}`), then run "
                     f"`mcore-compat doctor --for {release.version}` again")
        return Plan(release, release.python, here, None, None, (), tuple(notes))
    if found.found_by != "PATH":
        notes.append(f"Python {found.version} is installed but not on PATH ({found.found_by}): the commands use "
                     f"its full path")
    target = venv or f".venv{release.python.replace('.', '')}"
    py = shlex.quote(f"{target}/bin/python")
    torch_cmd = f"{py} -m pip install {shlex.quote(torch_req[0]) if torch_req else 'torch'}"
    if not gpu:
        torch_cmd += f" --index-url {CPU_TORCH_INDEX}"
        notes.append(_CPU_NOTE)
    commands = [f"{shlex.quote(found.path)} -m venv {shlex.quote(target)}", torch_cmd,
                f"{py} -m pip install {shlex.quote(_project_requirement())} einops",
                *_megatron_install(release, py, limits), f"{shlex.quote(target)}/bin/mcore-compat doctor"]
    return Plan(release, release.python, here, found, None, tuple(commands), tuple(notes))
