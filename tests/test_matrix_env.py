"""The noxfile's machinery (``ci/``): locks, interpreter lookup, stamps, release trees, the self-install, results
and the scheduler. Temporary directories and a fake pip; no network, no megatron-core."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import types
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # ``ci`` is not installed; the rest of the repository stays off sys.path
try:
    from ci import jobs, matrix_env, probe, results, scheduler
    from ci.matrix_env import Layout, MatrixEnv
    from ci.output import JobError, Out
finally:
    sys.path.remove(str(ROOT))

pytestmark = pytest.mark.unit


class FakePip(Out):
    """An ``Out`` whose commands are recorded and pretend to be ``venv``/``pip`` (writing what they would)."""

    def __init__(self, log: Path | None = None, installed: set[str] | None = None) -> None:
        super().__init__(log)
        self.commands: list[list[str]] = []
        self.said: list[str] = []
        self.installed = installed if installed is not None else set()
        self.pip_installs = True

    def say(self, text: str) -> None:
        self.said.append(text)

    def run(self, argv: Sequence[str | Path], env: dict[str, str] | None = None, check: bool = True,
            cwd: Path | None = None) -> int:
        args = [str(a) for a in argv]
        self.commands.append(args)
        if args[1:3] == ["-m", "venv"]:
            exe = Path(args[3]) / "bin" / "python"
            exe.parent.mkdir(parents=True)
            exe.write_text("#!/bin/sh\n")
            self.installed.clear()
        elif args[1:4] == ["-m", "pip", "install"] and "--target" in args:
            target = Path(args[args.index("--target") + 1])
            (target / "pkg").mkdir(parents=True)
            (target / "pkg" / "__init__.py").write_text(f"# from {Path(args[-1]).name}\n")
        elif args[1:4] == ["-m", "pip", "install"]:
            if self.pip_installs:
                self.installed.update(args[4:])
        elif args[1:4] == ["-m", "pip", "wheel"]:
            dist = Path(args[args.index("-w") + 1])
            dist.mkdir(parents=True)
            (dist / "mcore_compat-0.1.0-py3-none-any.whl").write_text("wheel")
        return 0

    def kinds(self) -> list[str]:
        """``venv``, ``pip install``, ``pip wheel``, ... per command."""
        return [c[2] if c[2] == "venv" else f"{c[2]} {c[3]}" for c in self.commands]


class _Matrix:
    def __init__(self, requirements: list[str]) -> None:
        self.requirements = requirements

    def base_requirements(self, python: str) -> list[str]:
        return list(self.requirements)


def _env(tmp_path: Path, reqs: list[str], pip: FakePip, monkeypatch: pytest.MonkeyPatch) -> MatrixEnv:
    """A MatrixEnv in ``tmp_path`` whose base probe asks the fake pip what it installed."""
    env = MatrixEnv(Layout(tmp_path), _Matrix(reqs), tools_python="9.9")

    def unmet(python: str, requirements: Sequence[str]) -> list[str] | None:
        if not env.layout.base_python(python).exists():
            return None
        return [r for r in requirements if r not in pip.installed]

    monkeypatch.setattr(env, "unmet", unmet)
    monkeypatch.setattr(matrix_env, "find_python", lambda python: f"/fake/python{python}")
    monkeypatch.delenv("MCORE_COMPAT_REBUILD_BASE", raising=False)
    return env


# ------------------------------------------------------------------------------------------- locks
def test_file_lock_excludes_and_says_it_waits(tmp_path: Path) -> None:
    first, second = FakePip(), FakePip()
    held, order = threading.Event(), []

    def holder() -> None:
        with matrix_env.file_lock(tmp_path / "locks", "base-py311", first):
            order.append("first in")
            held.set()
            time.sleep(0.3)
            order.append("first out")

    t = threading.Thread(target=holder)
    t.start()
    held.wait(5)
    with matrix_env.file_lock(tmp_path / "locks", "base-py311", second):
        order.append("second in")
    t.join()
    assert order == ["first in", "first out", "second in"]
    assert second.said == ["waiting for the lock base-py311 (another session is preparing it)"]
    assert first.said == []
    with matrix_env.file_lock(tmp_path / "locks", "other", second):  # a free lock is taken without a word
        pass
    assert len(second.said) == 1


# ------------------------------------------------------------------------------------------- interpreters
def _script(path: Path, body: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_interpreter_candidates_order(tmp_path: Path) -> None:
    on_path = _script(tmp_path / "bin" / "python3.12", "exit 1")
    old = _script(tmp_path / "pyenv" / "versions" / "3.12.1" / "bin" / "python3.12", "exit 1")
    new = _script(tmp_path / "pyenv" / "versions" / "3.12.10" / "bin" / "python3.12", "exit 1")
    environ = {"MCORE_COMPAT_PYTHON_3_12": "/opt/py/bin/python3.12", "PYENV_ROOT": str(tmp_path / "pyenv"),
               "PATH": str(tmp_path / "bin")}
    assert matrix_env.interpreter_candidates("3.12", environ) == [
        "/opt/py/bin/python3.12", on_path, new, old, "/usr/local/bin/python3.12", "/usr/bin/python3.12"]
    environ = {"PYENV_ROOT": str(tmp_path / "none"), "PATH": str(tmp_path / "empty")}
    assert matrix_env.interpreter_candidates("3.12", environ) == ["/usr/local/bin/python3.12",
                                                                  "/usr/bin/python3.12"]


def test_find_python_skips_broken_and_wrong_interpreters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(matrix_env, "_FOUND_PYTHONS", {})
    shim = _script(tmp_path / "shim", "echo 'pyenv: python3.12: command not found' >&2; exit 127")
    wrong = _script(tmp_path / "wrong", "echo 3.11")
    good = _script(tmp_path / "good", "echo 3.12")
    monkeypatch.setattr(matrix_env, "interpreter_candidates",
                        lambda python, environ=None: [str(tmp_path / "missing"), shim, wrong, good])
    assert matrix_env.find_python("3.12") == good
    monkeypatch.setattr(matrix_env, "interpreter_candidates", lambda python, environ=None: [shim])
    assert matrix_env.find_python("3.12") == good  # cached for the process
    with pytest.raises(JobError, match=r"no working Python 3\.13 .*MCORE_COMPAT_PYTHON_3_13"):
        matrix_env.find_python("3.13")


# ------------------------------------------------------------------------------------------- base venvs
def test_base_is_built_once_then_stamped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pip = FakePip()
    env = _env(tmp_path, ["torch==2.13.0", "numpy<2"], pip, monkeypatch)
    exe = env.ensure_base("3.11", pip)
    assert exe == tmp_path / ".cache" / "base-py311" / "bin" / "python"
    assert pip.kinds() == ["venv", "pip install"]
    assert pip.commands[0][0] == "/fake/python3.11"
    assert pip.commands[1][4:] == ["torch==2.13.0", "numpy<2", *matrix_env.TEST_TOOLS]
    stamp = tmp_path / ".cache" / "base-py311" / ".mcore-compat-stamp"
    assert stamp.read_text().strip() == matrix_env.digest(
        {"python": "3.11", "requirements": env.base_requirements("3.11")})
    pip.commands.clear()
    assert env.ensure_base("3.11", pip) == exe
    assert pip.commands == []


def test_changed_requirements_top_up_the_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pip = FakePip()
    env = _env(tmp_path, ["numpy<2"], pip, monkeypatch)
    env.ensure_base("3.11", pip)
    env.matrix.requirements.append("einops")
    pip.commands.clear()
    env.ensure_base("3.11", pip)
    assert pip.kinds() == ["pip install"]  # no new venv
    assert any("(unmet: ['einops'])" in s for s in pip.said)
    pip.commands.clear()
    env.matrix.requirements.remove("einops")  # a stamp mismatch with nothing unmet: no pip at all
    env.ensure_base("3.11", pip)
    assert pip.commands == []


def test_rebuild_forced_and_broken_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pip = FakePip()
    env = _env(tmp_path, ["numpy<2"], pip, monkeypatch)
    env.ensure_base("3.11", pip)
    (tmp_path / ".cache" / "base-py311" / ".mcore-compat-stamp").unlink()
    monkeypatch.setenv("MCORE_COMPAT_REBUILD_BASE", "1")
    pip.commands.clear()
    env.ensure_base("3.11", pip)
    assert pip.kinds() == ["venv", "pip install"]
    monkeypatch.delenv("MCORE_COMPAT_REBUILD_BASE")
    (tmp_path / ".cache" / "base-py311" / "bin" / "python").unlink()  # stamp fine, interpreter gone: rebuilt
    pip.commands.clear()
    env.ensure_base("3.11", pip)
    assert pip.kinds() == ["venv", "pip install"]


def test_a_base_that_stays_unmet_is_an_error_without_a_stamp(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    pip = FakePip()
    pip.pip_installs = False
    env = _env(tmp_path, ["numpy<2"], pip, monkeypatch)
    with pytest.raises(JobError, match="still does not satisfy"):
        env.ensure_base("3.11", pip)
    assert not (tmp_path / ".cache" / "base-py311" / ".mcore-compat-stamp").exists()


def test_tools_python_base_gets_the_lint_tools(tmp_path: Path) -> None:
    env = MatrixEnv(Layout(tmp_path), _Matrix(["numpy"]))
    assert env.base_requirements(env.tools_python) == ["numpy", *matrix_env.TEST_TOOLS, *matrix_env.LINT_TOOLS]
    assert any(t.startswith("mypy") for t in matrix_env.LINT_TOOLS)
    assert env.base_requirements("3.12") == ["numpy", *matrix_env.TEST_TOOLS]


def test_probe_reports_unmet_and_versions() -> None:
    assert probe.unmet(["pytest>=1", "pytest<1", "surely-not-a-distribution-xyz"]) == [
        f"pytest<1 (have {probe.md.version('pytest')})", "surely-not-a-distribution-xyz (missing)"]
    found = probe.versions(["pytest", "surely-not-a-distribution-xyz"])
    assert found["dists"] == {"pytest": probe.md.version("pytest"), "surely-not-a-distribution-xyz": None}


def test_unmet_runs_the_probe_in_the_base(tmp_path: Path) -> None:
    env = MatrixEnv(Layout(tmp_path), _Matrix([]))
    assert env.unmet("3.11", ["pytest"]) is None  # no base
    exe = env.layout.base_python("3.11")
    _script(exe, f'exec "{sys.executable}" "$@"')
    assert env.unmet("3.11", ["pytest>=1", "surely-not-a-distribution-xyz"]) == [
        "surely-not-a-distribution-xyz (missing)"]
    _script(exe, "exit 1")  # a broken base
    assert env.unmet("3.11", ["pytest"]) is None


def test_check_limits_names_the_broken_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = MatrixEnv(Layout(tmp_path), _Matrix([]))
    monkeypatch.setattr(env, "_probe", lambda python, command, items: {
        "python": "3.11.7", "dists": {"torch": "2.13.0", "numpy": "2.1.0", "setuptools": None}})
    release = types.SimpleNamespace(version="0.9.0", python="3.11",
                                    unmet_limits=lambda py, dists: ["numpy<2 (have 2.1.0)"])
    with pytest.raises(JobError, match=r"0.9.0: .*numpy<2 \(have 2.1.0\).*Fix \[base.\"3.11\"\]"):
        env.check_limits(release, FakePip())
    release.unmet_limits = lambda py, dists: []
    out = FakePip()
    env.check_limits(release, out)
    assert out.said == ["limits of 0.9.0 hold: python 3.11.7, torch 2.13.0, numpy 2.1.0, setuptools None"]


# ------------------------------------------------------------------------------------------- megatron-core
def _release(version: str, python: str = "3.11", install: str = "wheel", wheel_python: str = "") -> Any:
    return types.SimpleNamespace(version=version, python=python, install=install, wheel_python=wheel_python,
                                 session=f"mcore-{version}", tags=())


def test_wheel_fits() -> None:
    assert matrix_env.wheel_fits(Path("megatron_core-0.9.0-cp311-cp311-manylinux_2_28_x86_64.whl"), "3.11")
    assert not matrix_env.wheel_fits(Path("megatron_core-0.9.0-cp312-cp312-manylinux_2_28_x86_64.whl"), "3.11")
    assert matrix_env.wheel_fits(Path("megatron_core-0.1.0-py3-none-any.whl"), "3.12")


def test_release_tree_from_a_wheel_is_installed_once(tmp_path: Path) -> None:
    env = MatrixEnv(Layout(tmp_path), _Matrix([]))
    env.layout.wheels.mkdir(parents=True)
    for tag in ("cp312-cp312", "cp311-cp311"):
        (env.layout.wheels / f"megatron_core-0.16.1-{tag}-manylinux_2_28_x86_64.whl").write_text("")
    pip, rel = FakePip(), _release("0.16.1")
    target = env.ensure_mc(rel, pip)
    assert target == tmp_path / ".cache" / "mc" / "0.16.1" and (target / "pkg").is_dir()
    assert pip.kinds() == ["pip install"] and pip.commands[0][-1].endswith("cp311-cp311-manylinux_2_28_x86_64.whl")
    assert not target.with_name("0.16.1.tmp").exists()
    pip.commands.clear()
    assert env.ensure_mc(rel, pip) == target and pip.commands == []


def test_unpack_wheel_release_has_no_metadata(tmp_path: Path) -> None:
    env = MatrixEnv(Layout(tmp_path), _Matrix([]))
    env.layout.wheels.mkdir(parents=True)
    wheel = env.layout.wheels / "megatron_core-0.4.0-cp310-cp310-manylinux2014_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("megatron/core/__init__.py", "")
        zf.writestr("megatron_core-0.4.0.dist-info/METADATA", "Name: megatron-core\n")
    pip = FakePip()
    target = env.ensure_mc(_release("0.4.0", install="unpack-wheel", wheel_python="3.10"), pip)
    assert sorted(p.name for p in target.iterdir()) == ["megatron"]
    assert (target / "megatron" / "core" / "__init__.py").is_file()
    # no pip; the tree is byte-compiled (PYTHONDONTWRITEBYTECODE would make every import compile it again)
    assert [c[1:4] for c in pip.commands] == [["-m", "compileall", "-q"]]


def test_a_missing_wheel_is_downloaded_for_its_python(tmp_path: Path) -> None:
    env = MatrixEnv(Layout(tmp_path), _Matrix([]))

    class Download(FakePip):
        def run(self, argv: Sequence[str | Path], env: dict[str, str] | None = None, check: bool = True,
                cwd: Path | None = None) -> int:
            args = [str(a) for a in argv]
            self.commands.append(args)
            dest = Path(args[args.index("-d") + 1])
            (dest / "megatron_core-0.4.0-cp310-cp310-manylinux2014_x86_64.whl").write_text("")
            return 0

    pip = Download()
    wheel = env.ensure_wheel(_release("0.4.0", install="unpack-wheel", wheel_python="3.10"), pip)
    assert wheel.name.startswith("megatron_core-0.4.0-cp310")
    assert pip.commands[0][1:4] == ["-m", "pip", "download"] and "3.10" in pip.commands[0]
    with pytest.raises(JobError, match=r"left no megatron_core-0\.9\.0"):
        env.ensure_wheel(_release("0.9.0"), pip)


# ------------------------------------------------------------------------------------------- mcore-compat
def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "mcore_compat" / "__pycache__").mkdir(parents=True)
    (repo / "mcore_compat" / "__init__.py").write_text("x = 1\n")
    (repo / "mcore_compat" / "__pycache__" / "x.pyc").write_text("")
    (repo / "patches").mkdir()
    (repo / "patches" / "__init__.py").write_text("")
    (repo / "tests").mkdir()
    (repo / "tests" / "test_x.py").write_text("")
    (repo / "README.md").write_text("readme\n")
    (repo / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"mcore_compat" = "mcore_compat"\n'
                                         '"mcore_compat.patches" = "patches"\n')
    return repo


def test_self_install_follows_the_sources_across_runs_not_within_one(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    env, pip = MatrixEnv(Layout(repo), _Matrix([])), FakePip()
    rel = sorted(str(p.relative_to(repo)) for p in env.source_files())
    assert rel == ["README.md", "mcore_compat/__init__.py", "patches/__init__.py", "pyproject.toml"]
    target = env.ensure_mcc("3.11", pip)
    assert target == repo / ".cache" / "mcc" / "py311" and pip.kinds() == ["pip wheel", "pip install"]
    assert (repo / ".cache" / "mcc" / "src" / "patches" / "__init__.py").is_file()
    (repo / "mcore_compat" / "__init__.py").write_text("x = 2\n")
    pip.commands.clear()
    env.ensure_mcc("3.11", pip)
    assert pip.commands == []  # the same run tests the same code
    env.ensure_mcc("3.12", pip)
    assert pip.kinds() == ["pip install"]  # the wheel of this run is reused for the other Python
    pip.commands.clear()
    MatrixEnv(Layout(repo), _Matrix([])).ensure_mcc("3.11", pip)  # a new run sees the change
    assert pip.kinds() == ["pip wheel", "pip install"]
    pip.commands.clear()
    MatrixEnv(Layout(repo), _Matrix([])).ensure_mcc("3.11", pip)
    assert pip.commands == []


def test_session_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = MatrixEnv(Layout(tmp_path), _Matrix([]))
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "MCORE_COMPAT_VERSION", "PYTHONHOME", "PYTHONSAFEPATH"):
        monkeypatch.setenv(name, "x")
    monkeypatch.setenv("PATH", "/usr/bin")
    got = env.session_env("3.11", _release("0.16.1"))
    cache = tmp_path / ".cache"
    assert got["PYTHONPATH"] == f"{cache / 'mc' / '0.16.1'}{os.pathsep}{cache / 'mcc' / 'py311'}"
    assert got["PATH"] == f"{cache / 'base-py311' / 'bin'}{os.pathsep}/usr/bin"
    assert got["OMP_NUM_THREADS"] == "1" and got["PYTHONNOUSERSITE"] == "1"
    assert not {"VIRTUAL_ENV", "MCORE_COMPAT_VERSION", "PYTHONHOME", "PYTHONSAFEPATH"} & set(got)
    assert env.session_env("3.11")["PYTHONPATH"] == str(cache / "mcc" / "py311")


# ------------------------------------------------------------------------------------------- results
def test_counts_text_and_many_failures(tmp_path: Path) -> None:
    assert results.counts_text(results.JobResult("a", ok=True)) == "ok"
    assert results.counts_text(results.JobResult("a")) == "failed"
    assert results.counts_text(results.JobResult("a", passed=3, errors=2)) == "3 passed, 2 errors"
    xml = tmp_path / "j.xml"
    cases = "".join(f'<testcase classname="m" name="t{i}"><error/></testcase>' for i in range(23))
    xml.write_text(f'<testsuite tests="23" errors="23">{cases}</testsuite>')
    res = results.JobResult("x")
    results.junit_counts(xml, res)
    assert res.errors == 23 and res.passed == 0 and res.details.endswith("m::t19 (+3 more)")
    results.junit_counts(tmp_path / "missing.xml", res)
    assert res.errors == 23


# ------------------------------------------------------------------------------------------- jobs
def test_lint_runs_ruff_mypy_and_the_api_check_and_fails_for_any(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    env = MatrixEnv(Layout(tmp_path), _Matrix([]))
    monkeypatch.setattr(env, "ensure_base", lambda python, out: Path("/base/python"))
    for codes, ok in (({"ruff": 0, "mypy": 0, "gen_api.py": 0}, True), ({"ruff": 0, "mypy": 1, "gen_api.py": 0}, False),
                      ({"ruff": 1, "mypy": 0, "gen_api.py": 0}, False), ({"ruff": 0, "mypy": 0, "gen_api.py": 1}, False)):
        seen: list[list[str]] = []

        def run(self: Out, argv: Sequence[str | Path], env: Any = None, check: bool = True, cwd: Any = None,
                codes: dict[str, int] = codes, seen: list[list[str]] = seen) -> int:
            seen.append([str(a) for a in argv])
            return codes[str(argv[2]) if str(argv[1]) == "-m" else Path(argv[1]).name]

        monkeypatch.setattr(FakePip, "run", run)
        res = jobs.run_lint(env, FakePip(), ["--fix"])
        assert [a[2] for a in seen] == ["ruff", "mypy", "--check"] and seen[0][-1] == "--fix"
        assert seen[1][3:] == list(jobs.MYPY_PATHS) and seen[2][1] == "scripts/gen_api.py"
        assert res.ok is ok and res.errors == (0 if ok else 1)
        if not ok:
            assert "exited with status 1" in res.details


def test_a_failed_start_up_check_fails_the_release(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = MatrixEnv(Layout(tmp_path), _Matrix([]))
    for step in ("ensure_base", "check_limits", "ensure_mc", "ensure_mcc"):
        monkeypatch.setattr(env, step, lambda *a: tmp_path)

    class Fails(FakePip):
        def run(self, argv: Sequence[str | Path], env: Any = None, check: bool = True, cwd: Any = None) -> int:
            self.commands.append([str(a) for a in argv])
            return 3

    out = Fails()
    res = jobs.run_release(env, _release("0.16.1"), out)
    assert not res.ok and res.errors == 1 and "start-up check failed (exit status 3)" in res.details
    assert out.commands[0][2].endswith("ci/startup_check.py") and out.commands[0][3] == "0.16.1"
    assert len(out.commands) == 1  # no pytest after a failed start-up check


# ------------------------------------------------------------------------------------------- scheduler
def test_parse_matrix_args() -> None:
    assert scheduler.parse_matrix_args([]) == scheduler.MatrixOptions(2, None, True)
    assert scheduler.parse_matrix_args(["--jobs", "0", "--tag", "py312", "--no-record"]) == \
        scheduler.MatrixOptions(1, "py312", False)
    for bad in (["--jobs"], ["--jobs", "x"], ["--fast"]):
        with pytest.raises(JobError):
            scheduler.parse_matrix_args(bad)


def test_start_order_heaviest_first_by_base_and_the_light_jobs_last() -> None:
    """Long sessions first (the launcher ones), the first base's jobs before the next base's (which may still be
    building), unit and lint last: the matrix does not end with one long session running alone."""
    def job(name: str, python: str, weight: float = 1.0) -> scheduler.Job:
        return scheduler.Job(name, python, lambda out: results.JobResult(name), weight)

    jobs = [job("unit", "3.11", 0.5), job("lint", "3.11", 0.2), job("mcore-0.4.0", "3.11", 1.15),
            job("mcore-0.5.0", "3.11"), job("mcore-0.17.0", "3.12", 1.15), job("mcore-0.17.1", "3.12"),
            job("mcore-0.16.1", "3.11", 1.15)]
    assert [j.name for j in scheduler.start_order(jobs)] == [
        "mcore-0.4.0", "mcore-0.16.1", "mcore-0.5.0", "mcore-0.17.0", "mcore-0.17.1", "unit", "lint"]


def test_scheduler_waits_for_bases_keeps_order_and_limits_parallelism(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    env = MatrixEnv(Layout(tmp_path), _Matrix([]))
    built: list[str] = []
    lock = threading.Lock()
    running, peak = [0], [0]

    def ensure_base(python: str, out: Out) -> Path:
        time.sleep(0.1)
        if python == "3.12":
            raise JobError("no torch for 3.12")
        built.append(python)
        return tmp_path

    monkeypatch.setattr(env, "ensure_base", ensure_base)

    def body(name: str, seconds: float) -> scheduler.Body:
        def run(out: Out) -> results.JobResult:
            assert built == ["3.11"]  # the base is ready before its jobs start
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            time.sleep(seconds)
            with lock:
                running[0] -= 1
            out.say(f"{name} ran")
            return results.JobResult(name, ok=True, passed=1)
        return run

    job_list = [scheduler.Job("slow", "3.11", body("slow", 0.4)), scheduler.Job("new", "3.12", body("new", 0)),
                scheduler.Job("fast", "3.11", body("fast", 0.0)), scheduler.Job("mid", "3.11", body("mid", 0.1))]
    got = scheduler.run_jobs(env, job_list, parallel=2)
    assert [r.name for r in got] == ["slow", "new", "fast", "mid"]
    assert peak[0] == 2
    assert not got[1].ok and got[1].errors == 1 and "base environment failed: no torch for 3.12" in got[1].details
    assert (tmp_path / ".cache" / "logs" / "fast.log").read_text() == "fast ran\n"
    failed = scheduler.report(got, time.monotonic(), tmp_path / "summary.txt")
    assert failed == ["new"]
    assert (tmp_path / "summary.txt").read_text().startswith("==== 3 passed, 1 error in ")


def test_run_matrix_records_and_regenerates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recorded: list[tuple[str, str, dict[str, Any]]] = []
    matrix = types.SimpleNamespace(
        releases=lambda: [_release("0.9.0"), _release("0.17.0", python="3.12")],
        record_result=lambda v, kind, rec: recorded.append((v, kind, rec)),
        write_readme=lambda: tmp_path / "matrix" / "README.md")
    env = MatrixEnv(Layout(tmp_path), matrix)
    monkeypatch.setattr(env, "ensure_base", lambda python, out: tmp_path)
    ok = lambda name: results.JobResult(name, ok=True, passed=2)  # noqa: E731
    monkeypatch.setattr(scheduler, "run_unit", lambda env, out: ok("unit"))
    monkeypatch.setattr(scheduler, "run_lint", lambda env, out: ok("lint"))
    monkeypatch.setattr(scheduler, "run_docs", lambda env, out: ok("docs"))
    monkeypatch.setattr(scheduler, "run_release", lambda env, rel, out: ok(rel.session))
    lines: list[str] = []
    assert scheduler.run_matrix(env, ["--tag", "", "--jobs", "2"], lines.append) == []  # "" is no release's tag
    assert recorded == [] and "0 releases" in lines[0]
    assert scheduler.run_matrix(env, [], lines.append) == []
    assert [(v, k) for v, k, _ in recorded] == [("0.9.0", "cpu"), ("0.17.0", "cpu")]
    assert recorded[0][2]["result"] == "pass" and recorded[0][2]["passed"] == 2
    assert lines[-1] == "regenerated matrix/README.md and recorded CPU results"
    assert env.layout.summary_file.read_text().startswith("==== 10 passed in ")
    assert json.dumps(recorded[0][2])  # JSON-able, as results.json needs


def test_timing_line_and_record_say_where_a_session_went(capsys: pytest.CaptureFixture[str]) -> None:
    """The table printed at the end of every matrix run: one line per session from its phases and what the suite
    measured inside pytest (tests/conftest.py); the compact record goes into results.json."""
    result = results.JobResult("mcore-0.16.1", ok=True, passed=3, seconds=150.0)
    result.timing = {"prepare": 4.04, "startup": 0.31, "pytest": 120.0, "selfcheck": 21.5, "inside_pytest": {
        "seconds": 119.0, "collect": 2.5, "setup": 60.0, "call": 50.0, "teardown": 1.0,
        "rank_starts": [{"nprocs": 2, "method": "forkserver", "seconds": 7.2, "import_seconds": 0.0,
                         "init_seconds": 0.0},
                        {"nprocs": 4, "method": "spawn", "seconds": 11.0, "import_seconds": 6.5,
                         "init_seconds": 0.0}],
        "subprocesses": {"count": 9, "seconds": 30.25},
        "modules": {"tests/test_selfcheck_real.py": 25.0, "tests/test_cli.py": 20.0, "tests/a.py": 1.0,
                    "tests/b.py": 0.5}}}
    rec = results.timing_record(result)
    assert rec == {"prepare": 4.0, "startup": 0.3, "pytest": 120.0, "selfcheck": 21.5, "collect": 2.5,
                   "rank_starts": [{"nprocs": 2, "method": "forkserver", "seconds": 7.2, "import_seconds": 0.0},
                                   {"nprocs": 4, "method": "spawn", "seconds": 11.0, "import_seconds": 6.5}],
                   "subprocesses": {"count": 9, "seconds": 30.2},
                   "slowest_modules": {"tests/test_selfcheck_real.py": 25.0, "tests/test_cli.py": 20.0,
                                       "tests/a.py": 1.0}}
    assert results.cpu_record("wheel", result)["timing"] == rec
    line = results.timing_line(result)
    assert line.split() == ["mcore-0.16.1", "150.0", "4.0", "0.3", "120.0", "2.5", "2:", "2f", "7.2(0.0)+4s",
                            "11.0(6.5)", "9:", "30.2", "21.5", "test_selfcheck_real.py", "25.0"]
    bare = results.timing_line(results.JobResult("lint", ok=True, seconds=3.0))
    assert bare.split() == ["lint", "3.0", "-", "-", "-", "-", "-", "-", "-"]
    scheduler.report([result], time.monotonic(), Path(os.devnull))
    printed = capsys.readouterr().out.splitlines()
    assert printed[2] == results.TIMING_HEADER and printed[3] == line
