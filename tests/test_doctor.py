"""``mcore-compat doctor`` as a user runs it: ``python -m mcore_compat doctor`` in a fresh process (the ``mcore``
tests: its runs one after another in one fresh process, see ``runs``).

Tests marked ``mcore`` run it against the release on ``sys.path`` and check what it reports against facts read
independently of mcore-compat: the version from the release's ``megatron/core/package_info.py`` (parsed, not
imported), the directory the release lies in, whether it has distribution metadata. The ``unit`` tests run it
where no megatron-core is importable.

Every run starts in an empty directory, so that a source checkout in the current directory cannot shadow the
mcore-compat under test.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.metadata as md
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import run_in_one_process
from packaging.version import Version

import mcore_compat
from mcore_compat.capabilities import facts
from mcore_compat.support import releases
from mcore_compat.symbols import symbol_names

#: Seconds one doctor run may take (``--probe`` imports torch and Megatron).
_TIMEOUT = 600


def _doctor(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mcore_compat", "doctor", *args], capture_output=True, text=True,
                          cwd=cwd, env=os.environ.copy() if env is None else env, timeout=_TIMEOUT, check=False)


def _core_dir() -> Path:
    """``megatron/core`` of the release on ``sys.path``, found without importing anything."""
    spec = importlib.machinery.PathFinder.find_spec("megatron")
    assert spec is not None, "no megatron on sys.path"
    for loc in spec.submodule_search_locations or ():
        if (Path(loc) / "core" / "__init__.py").is_file():
            return Path(loc) / "core"
    raise AssertionError(f"no megatron/core/__init__.py under {list(spec.submodule_search_locations or ())}")


def _release_version(core: Path) -> str:
    """The version ``package_info.py`` of ``core`` declares (``MAJOR.MINOR.PATCH`` + ``PRE_RELEASE``)."""
    fields: dict[str, Any] = {}
    for node in ast.parse((core / "package_info.py").read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and node.targets[0].id in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE"):
            fields[node.targets[0].id] = ast.literal_eval(node.value)
    return f"{fields['MAJOR']}.{fields['MINOR']}.{fields['PATCH']}{fields.get('PRE_RELEASE', '')}"


def _distribution_name() -> str | None:
    """The name megatron-core's distribution metadata gives (``None``: the release has no metadata)."""
    try:
        return str(md.distribution("megatron-core").metadata["Name"])
    except md.PackageNotFoundError:
        return None


def _listed(version: str) -> bool:
    """Whether ``version`` is a release of the support matrix (``matrix/versions.toml``)."""
    return Version(version) in [r.version for r in releases()]


def _jsonable(value: object) -> object:
    """``value`` as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(value))


def _section(lines: list[str], title: str) -> list[str]:
    """The indented lines under the line that starts with ``title`` (up to the next blank line)."""
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    body = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        body.append(line)
    return body


def _patches() -> list[Any]:
    from mcore_compat import patches

    return patches.list_patches()


# ---- a real megatron-core ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def release() -> tuple[str, Path]:
    """The installed release's version (from its ``package_info.py``) and its ``megatron/core`` directory."""
    core = _core_dir()
    return _release_version(core), core


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("doctor")


@pytest.fixture(scope="module")
def runs(workdir: Path, release: tuple[str, Path]) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every doctor run against the installed release, by name, made one after another in ONE fresh process in
    ``workdir`` (``run_in_one_process``: torch, which doctor reports on, starts once instead of five times).
    Doctor changes nothing in the process it runs in, save for what orders the runs: ``--json`` comes first (its
    test asserts a fresh process has applied no patch) and ``--probe``, which imports megatron.core, last."""
    order = {"json": ["--json"], "text": [], "verbose": ["--verbose"],
             "other_version": ["--expect-version", "0.0.1"], "probe": ["--probe", "--expect-version", release[0]]}
    done = run_in_one_process([["-m", "mcore_compat", "doctor", *args] for args in order.values()], workdir,
                              timeout=_TIMEOUT)
    return dict(zip(order, done, strict=True))


@pytest.fixture(scope="module")
def text_run(runs: dict[str, subprocess.CompletedProcess[str]]) -> subprocess.CompletedProcess[str]:
    return runs["text"]


@pytest.fixture(scope="module")
def verbose_run(runs: dict[str, subprocess.CompletedProcess[str]]) -> subprocess.CompletedProcess[str]:
    return runs["verbose"]


@pytest.fixture(scope="module")
def json_run(runs: dict[str, subprocess.CompletedProcess[str]]) -> subprocess.CompletedProcess[str]:
    return runs["json"]


@pytest.mark.mcore
def test_doctor_names_the_installed_release(text_run: subprocess.CompletedProcess[str],
                                            release: tuple[str, Path]) -> None:
    version, core = release
    assert text_run.returncode == 0, text_run.stderr
    lines = text_run.stdout.splitlines()
    assert f"mcore-compat {mcore_compat.__version__}" in " ".join(lines[0].split())
    [mcore] = [line for line in lines if line.startswith("megatron-core")]
    assert mcore.split()[1] == version, mcore
    name = _distribution_name()
    assert (f"distribution {name}" in mcore) if name else ("source checkout (no metadata)" in mcore), mcore
    [where] = [line for line in lines if line.strip().startswith("imported from")]
    assert Path(where.split("imported from", 1)[1].strip()) == core.resolve()
    [support] = [line for line in lines if line.startswith("support")]
    assert version in support and ("is a supported release" in support) == _listed(version), support


@pytest.mark.mcore
def test_doctor_fits_a_screen_and_says_the_installation_is_usable(text_run: subprocess.CompletedProcess[str],
                                                                  release: tuple[str, Path]) -> None:
    """The default output: at most 30 lines, the supported releases, the environment against the release's
    limits (the session's base satisfies them), the verdict last; the tables only with --verbose."""
    version = release[0]
    lines = text_run.stdout.splitlines()
    assert len(lines) <= 30, text_run.stdout
    listed = " ".join(ln for ln in lines if ln.startswith(("releases", " " * 19))).split()
    assert {str(r.version) for r in releases()} <= set(listed), listed
    [environment] = [line for line in lines if line.startswith("environment")]
    assert f"fits the limits of {version}" in environment, environment
    assert lines[-1] == f"doctor: OK (megatron-core {version} is usable here)", lines[-1]
    assert "facts (table" not in text_run.stdout and "--verbose" in text_run.stdout


@pytest.mark.mcore
def test_doctor_lists_every_fact_symbol_and_applicable_patch(verbose_run: subprocess.CompletedProcess[str],
                                                             release: tuple[str, Path]) -> None:
    version = Version(release[0])
    assert verbose_run.returncode == 0, verbose_run.stderr
    lines = verbose_run.stdout.splitlines()
    rows = {line.split()[1]: (line.split()[0], line.split(None, 2)[2]) for line in _section(lines, "facts")}
    assert set(rows) == {f.name for f in facts()}
    for f in facts():
        mark, rest = rows[f.name]
        if f.is_flag:
            assert mark == ("yes" if f.value_for(version) else "no"), (f.name, mark)
        else:  # a valued fact prints its value for the release
            assert mark == "=" and rest.strip() == repr(f.value_for(version)), (f.name, rest)
    surface = {line.split()[0]: line for line in _section(lines, "import surface")}
    assert sorted(surface) == symbol_names()
    assert any("unavailable" not in line for line in surface.values())
    listed = {line.split()[0] for line in _section(lines, "patches")}
    assert listed == {p.name for p in _patches() if p.applies_to(version)}


@pytest.mark.mcore
def test_doctor_json_is_the_same_report(json_run: subprocess.CompletedProcess[str],
                                        release: tuple[str, Path]) -> None:
    version, core = release
    assert json_run.returncode == 0, json_run.stderr
    report = json.loads(json_run.stdout)
    assert report["mcore_compat"] == mcore_compat.__version__
    m = report["megatron_core"]
    assert m["found"] is True and m["version"] == version and Path(m["path"]) == core.resolve()
    assert m["checkout"] is (_distribution_name() is None) and m["distribution"] == _distribution_name()
    assert report["support"]["listed"] is _listed(version)
    assert report["verdict"] == {"ok": True, "problems": [], "notes": [], "fix": None}
    assert report["environment"]["ok"] is True and report["environment"]["release"] == version
    assert {f["name"]: f["value"] for f in report["facts"]} == {
        f.name: _jsonable(f.value_for(Version(version))) for f in facts()}
    assert sorted(s["name"] for s in report["symbols"]) == symbol_names()
    patches = {p["name"]: p for p in report["patches"]}
    assert set(patches) == {p.name for p in _patches()}
    # a fresh process has applied nothing, and the installed code is the code every applicable patch expects
    assert not any(p["applied"] for p in patches.values())
    assert [n for n, p in patches.items() if p["applies"] and p["refused"]] == []


@pytest.mark.mcore
def test_doctor_probe_agrees_with_the_real_module(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """``--probe`` imports megatron.core and checks every fact against its probe; ``--expect-version`` the
    release."""
    proc = runs["probe"]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = _section(proc.stdout.splitlines(), "facts")
    assert len(rows) == len(facts()) and all("probe=agrees" in row for row in rows), [r for r in rows if "probe=agrees" not in r]


@pytest.mark.mcore
def test_doctor_fails_on_another_expected_version(runs: dict[str, subprocess.CompletedProcess[str]],
                                                  release: tuple[str, Path]) -> None:
    proc = runs["other_version"]
    assert proc.returncode == 1
    assert "expected megatron-core 0.0.1" in proc.stderr and release[0] in proc.stderr, proc.stderr


# ---- no megatron-core --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bare_env(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A directory and an environment in which mcore-compat is importable and megatron is not: ``PYTHONPATH``
    holds only a link to the mcore_compat under test."""
    site = tmp_path_factory.mktemp("bare")
    (site / "mcore_compat").symlink_to(Path(mcore_compat.__file__).resolve().parent, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PYTHONPATH=str(site), PYTHONNOUSERSITE="1")
    found = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('megatron'))"],
                           capture_output=True, text=True, cwd=site, env=env, timeout=60, check=True).stdout
    if found.strip() != "None":
        pytest.skip(f"megatron is installed in the site-packages of {sys.executable} ({found.strip()}): no "
                    f"environment without it can be made by PYTHONPATH")
    return site, env


@pytest.mark.unit
def test_doctor_without_megatron_says_so_and_fails(bare_env: tuple[Path, dict[str, str]]) -> None:
    proc = _doctor(bare_env[0], env=bare_env[1])
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr
    [line] = [ln for ln in proc.stdout.splitlines() if "megatron-core" in ln and "NOT FOUND" in ln]
    assert "not installed" in line and "pip install megatron-core==" in line, line
    assert "facts (table" not in proc.stdout and "patches for this version" not in proc.stdout
    assert proc.stdout.count("megatron-core is not installed") == 1, proc.stdout  # said once, not again below
    assert "doctor: NOT USABLE" in proc.stdout


@pytest.mark.unit
def test_doctor_json_without_megatron(bare_env: tuple[Path, dict[str, str]]) -> None:
    proc = _doctor(bare_env[0], "--json", env=bare_env[1])
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert report["megatron_core"]["found"] is False
    assert "not installed" in report["megatron_core"]["error"]
    assert "facts" not in report and "patches" not in report
    assert report["verdict"]["ok"] is False and "pip install megatron-core==" in report["verdict"]["fix"]
    assert [r["version"] for r in report["releases"]] == [str(r.version) for r in releases()]
