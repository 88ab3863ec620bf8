"""The ``mcore-compat`` command as a new user meets it: switching releases, wrong installations, wrong arguments.

Every test runs the command (or a user's script) in a fresh process, in an empty directory, and checks the exit
status and what the user reads: one clear message, the command that fixes it, never a traceback.

The ``unit`` tests do not depend on the release and run once, in the unit session. The environments they need are
built as input, not by mocking Megatron: a ``megatron/core`` tree whose ``package_info.py`` holds the version under
test (0.3.0, an unreadable one, 0.8.0, ...) first on ``PYTHONPATH``, and distribution metadata (a ``.dist-info``
directory) that declares an installed version, e.g. setuptools 84. The ``mcore`` tests run in every release
session against the real release (a few subprocesses each: doctor, the pre-flight, one torchrun self-check, one
timeout).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

import mcore_compat
from mcore_compat.support import newest_for_python, releases

ROOT = Path(__file__).resolve().parents[1]
#: Where the mcore_compat under test is imported from (put first on the subprocesses' PYTHONPATH).
_OWN_SITE = str(Path(mcore_compat.__file__).resolve().parents[1])
_TIMEOUT = 600
#: A Python warning as printed to stderr: ``/path/file.py:12: FutureWarning: ...``.
_PRINTED_WARNING = re.compile(r"^\S+:\d+: \w*Warning: ", re.MULTILINE)


def _env(*front: Path, **extra: str) -> dict[str, str]:
    """The test's environment with ``front`` first on ``PYTHONPATH`` (and no version override unless given)."""
    env = {k: v for k, v in os.environ.items() if k != "MCORE_COMPAT_VERSION"}
    paths = [str(p) for p in front] + [_OWN_SITE] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.update(extra)
    return env


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = _TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout, check=False)


def _cli(cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-P", "-m", "mcore_compat", *args], cwd, env)


def _fake_release(root: Path, version: str) -> Path:
    """A ``megatron/core`` tree under ``root`` whose ``package_info.py`` says ``version``; returns ``root``."""
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("")
    (core / "package_info.py").write_text(f"__version__ = {version!r}\n")
    return root


def _dist(root: Path, name: str, version: str) -> None:
    """Distribution metadata under ``root`` that says ``name`` ``version`` is installed."""
    info = root / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def _no_traceback(proc: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]


def _fix_line(text: str) -> str:
    [line] = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("fix: ")]
    return line


def _pip(*requirements: str) -> str:
    """The fix as mcore-compat prints it for this interpreter."""
    from mcore_compat.support import pip_command

    return "fix: " + pip_command(*requirements, python=sys.executable)


def _newest_for_this_python() -> str:
    release = newest_for_python(releases(), ".".join(map(str, sys.version_info[:3])))
    assert release is not None
    return str(release.version)


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """An empty working directory (a checkout in the current directory must not shadow the package)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return cwd


@pytest.fixture(scope="module")
def no_megatron() -> None:
    """Skip where megatron is importable without PYTHONPATH (then no environment without it can be made)."""
    env = _env()
    env["PYTHONPATH"] = _OWN_SITE
    found = _run([sys.executable, "-P", "-c", "import importlib.util as u; print(u.find_spec('megatron'))"],
                 ROOT, env, 60).stdout.strip()
    if found != "None":
        pytest.skip(f"megatron is importable from {sys.executable}'s site-packages ({found})")


def _without_megatron(*front: Path, **extra: str) -> dict[str, str]:
    env = _env(*front, **extra)
    env["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in front), _OWN_SITE])
    return env


# ---- item 1: switching to a release whose limits the environment breaks -------------------------------------------
@pytest.mark.unit
def test_switching_to_080_next_to_setuptools_84_prints_the_pip_fix(no_megatron: None, tmp_path: Path,
                                                                   work: Path) -> None:
    site = _fake_release(tmp_path / "site", "0.8.0")
    _dist(site, "setuptools", "84.0.0")
    env = _without_megatron(site)
    doctor = _cli(work, env, "doctor")
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    _no_traceback(doctor)
    lines = doctor.stdout.splitlines()
    [support] = [ln for ln in lines if ln.startswith("support")]
    assert "0.8.0 is a supported release" in support
    [environment] = [ln for ln in lines if ln.startswith("environment")]
    assert "does NOT fit the limits of 0.8.0" in environment
    assert "doctor: NOT USABLE" in doctor.stdout
    assert "setuptools<81 is required" in doctor.stdout and "setuptools 84.0.0 is installed" in doctor.stdout
    assert _fix_line(doctor.stdout) == _pip("setuptools<81")

    check = _cli(work, env, "self-check", "--nproc", "2")
    assert check.returncode == 3 and check.stdout == "", check.stdout + check.stderr
    _no_traceback(check)
    assert "setuptools<81 is required" in check.stderr and _fix_line(check.stderr) == _pip("setuptools<81")
    assert "apply_for" not in check.stderr and "rank" not in check.stderr


# ---- item 2: a version that cannot be read; MCORE_COMPAT_VERSION ----------------------------------------------------
@pytest.mark.unit
def test_unreadable_version_names_the_tree_and_the_override_is_honoured(no_megatron: None, tmp_path: Path,
                                                                         work: Path) -> None:
    site = _fake_release(tmp_path / "site", "dev-build")
    core = (site / "megatron" / "core").resolve()
    doctor = _cli(work, _without_megatron(site), "doctor")
    assert doctor.returncode == 1
    _no_traceback(doctor)
    [line] = [ln for ln in doctor.stdout.splitlines() if ln.startswith("megatron-core")]
    assert "VERSION UNKNOWN" in line and "NOT FOUND" not in line and str(core) in line, line
    assert "'dev-build'" in line and "MCORE_COMPAT_VERSION=" in line, line

    forced = _cli(work, _without_megatron(site, MCORE_COMPAT_VERSION="0.16.1"), "doctor")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    [line] = [ln for ln in forced.stdout.splitlines() if ln.startswith("megatron-core")]
    assert line.split()[1] == "0.16.1" and "from MCORE_COMPAT_VERSION" in line, line
    assert forced.stdout.splitlines()[-1].startswith("doctor: OK")



@pytest.mark.unit
def test_an_override_that_disagrees_with_a_readable_version_stops_doctor_and_self_check(
        no_megatron: None, tmp_path: Path, work: Path) -> None:
    """``MCORE_COMPAT_VERSION=0.8.0`` next to a readable 0.16.1: an error naming both, in doctor and in the
    self-check's pre-flight (it used to pass doctor and fail later with a PatchRefusedError)."""
    site = _fake_release(tmp_path / "site", "0.16.1")
    env = _without_megatron(site, MCORE_COMPAT_VERSION="0.8.0")
    doctor = _cli(work, env, "doctor")
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    _no_traceback(doctor)
    [line] = [ln for ln in doctor.stdout.splitlines() if ln.startswith("megatron-core")]
    assert "VERSION CONFLICT: MCORE_COMPAT_VERSION=0.8.0 disagrees with the installed megatron-core 0.16.1" in line
    check = _cli(work, env, "self-check")
    assert check.returncode == 3, check.stdout + check.stderr
    _no_traceback(check)
    assert "MCORE_COMPAT_VERSION=0.8.0 disagrees with the installed megatron-core 0.16.1" in check.stderr

# ---- item 3: environment errors are one message from the parent, before any rank -----------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("case", ["missing", "0.3.0", "unreadable", "0.8.0 next to setuptools 84"])
def test_environment_errors_stop_the_self_check_before_any_rank(no_megatron: None, tmp_path: Path, work: Path,
                                                                case: str) -> None:
    site = tmp_path / "site"
    site.mkdir()
    expected = {"missing": "megatron-core is not installed", "0.3.0": "older than the oldest supported release",
                "unreadable": "cannot tell the version", "0.8.0 next to setuptools 84": "setuptools<81 is required"}
    if case != "missing":
        _fake_release(site, {"unreadable": "dev-build", "0.8.0 next to setuptools 84": "0.8.0"}.get(case, case))
    if case.endswith("setuptools 84"):
        _dist(site, "setuptools", "84.0.0")
    start = time.monotonic()
    proc = _cli(work, _without_megatron(site), "self-check", "--nproc", "2")
    took = time.monotonic() - start
    assert proc.returncode == 3, proc.stdout + proc.stderr
    _no_traceback(proc)
    assert proc.stdout == "" and proc.stderr.count(expected[case]) == 1, proc.stderr
    assert proc.stderr.splitlines()[0] == "mcore-compat self-check: cannot run here; nothing was started."
    assert "rank" not in proc.stderr and took < 60, (took, proc.stderr)
    if case == "0.3.0":
        assert "guard the use" not in proc.stderr  # the Python-API advice means nothing to a CLI user
        assert _fix_line(proc.stderr) == _pip(f"megatron-core=={_newest_for_this_python()}")
        debug = _cli(work, _without_megatron(site), "self-check", "--nproc", "2", "--debug")
        assert debug.returncode == 3 and "Traceback" in debug.stderr and "UnusableEnvironmentError" in debug.stderr


# ---- item 4: doctor lists the supported releases -------------------------------------------------------------------
@pytest.mark.unit
def test_doctor_lists_the_supported_releases_and_how_to_switch(no_megatron: None, tmp_path: Path,
                                                               work: Path) -> None:
    proc = _cli(work, _without_megatron(tmp_path), "doctor")
    assert proc.returncode == 1
    _no_traceback(proc)
    lines = proc.stdout.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("releases"))
    block: list[str] = []
    for ln in lines[start:]:
        if block and not ln.startswith(" "):
            break
        block.append(ln)
    listed = " ".join(block).split()
    for r in releases():
        assert str(r.version) in listed, (r.version, block)
    assert f"Python {releases()[-1].python}:" in " ".join(block)
    [switch] = [ln for ln in block if ln.strip().startswith("switch")]
    assert f"{sys.executable} -m pip install megatron-core==<V>" in switch
    assert _fix_line(proc.stdout) == _pip(f"megatron-core=={_newest_for_this_python()}")
    assert len(lines) <= 30, len(lines)


# ---- item 5: exit codes a shell chain can trust ----------------------------------------------------------------------
@pytest.mark.unit
def test_an_older_release_fails_doctor(no_megatron: None, tmp_path: Path, work: Path) -> None:
    site = _fake_release(tmp_path / "site", "0.3.0")
    proc = _cli(work, _without_megatron(site), "doctor")
    assert proc.returncode == 1
    _no_traceback(proc)
    assert "older than the oldest supported release (0.4.0)" in proc.stdout and "doctor: NOT USABLE" in proc.stdout
    assert _fix_line(proc.stdout) == _pip(f"megatron-core=={_newest_for_this_python()}")
    chained = _run(["sh", "-c", f"{sys.executable} -P -m mcore_compat doctor >/dev/null && echo reached"], work,
                   _without_megatron(site))
    assert "reached" not in chained.stdout


@pytest.mark.unit
def test_an_untested_release_needs_the_explicit_flag(no_megatron: None, tmp_path: Path, work: Path) -> None:
    """A patch release after the newest one tested on this Python (newer than every listed release on 3.12)."""
    newest = _newest_for_this_python()
    untested = ".".join(newest.split(".")[:2]) + ".99"
    site = _fake_release(tmp_path / "site", untested)
    env = _without_megatron(site)
    refused = _cli(work, env, "doctor")
    assert refused.returncode == 1 and "doctor: NOT USABLE" in refused.stdout
    assert f"{untested} is not a tested release" in refused.stdout or (
        f"{untested} is newer than the newest supported release" in refused.stdout), refused.stdout
    assert "--allow-untested" in refused.stdout
    accepted = _cli(work, env, "doctor", "--allow-untested")
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert f"note: megatron-core {untested} is" in accepted.stdout and "doctor: OK" in accepted.stdout


# ---- item 7: selfcheck.run() in a script without the __main__ guard --------------------------------------------------
@pytest.mark.unit
def test_selfcheck_run_without_main_guard_says_so(no_megatron: None, tmp_path: Path, work: Path) -> None:
    site = _fake_release(tmp_path / "site", "0.16.1")
    script = work / "check.py"
    script.write_text("from mcore_compat import selfcheck\n\nreport = selfcheck.run(nproc=2, device='cpu')\n"
                      "print(report.render())\n")
    proc = _run([sys.executable, "-P", str(script)], work, _without_megatron(site))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    _no_traceback(proc)
    assert 'if __name__ == "__main__":' in out and "self-check: FAIL" in out, out
    assert "AssertionError" not in out and "bootstrapping phase" not in out, out


# ---- item 8: --json to a path that cannot be written ---------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("target", ["missing-dir/report.json", "."])
def test_json_to_an_unwritable_path_fails_before_the_run(work: Path, target: str) -> None:
    proc = _cli(work, _env(), "self-check", "--json", target)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    _no_traceback(proc)
    assert proc.stdout == "" and proc.stderr.startswith(f"mcore-compat self-check: error: --json {target}: ")
    assert not (work / "missing-dir").exists()


# ---- item 10: argument errors ----------------------------------------------------------------------------------------
@pytest.mark.unit
def test_argument_errors_name_the_subcommand(work: Path) -> None:
    bogus = _cli(work, _env(), "self-check", "--bogus")
    assert bogus.returncode == 2
    # one line: what is wrong and where the usage is, not the ~20 options' usage first
    assert bogus.stderr == ("mcore-compat self-check: error: unrecognized arguments: --bogus "
                            "(see 'mcore-compat self-check --help')\n"), bogus.stderr
    fp8 = _cli(work, _env(), "self-check", "--dtype", "fp8")
    assert fp8.returncode == 2 and len(fp8.stderr.splitlines()) == 1, fp8.stderr
    assert "argument --dtype: invalid choice: 'fp8'" in fp8.stderr
    _no_traceback(fp8)
    sweep = _cli(work, _env(), "self-check", "--sweep", "--tp", "2")
    assert sweep.returncode == 2
    assert "--sweep runs its own configurations; drop --tp" in sweep.stderr
    helptext = " ".join(_cli(work, _env(), "self-check", "--help").stdout.split())
    assert "PP=N with tied embeddings" in helptext and "are refused" in helptext
    assert "once the ranks are up" in helptext  # --timeout


# ---- item 11: the checkout and the README for a new user -------------------------------------------------------------
@pytest.mark.unit
def test_the_checkout_ignores_the_venv_the_readme_creates() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "python3 -m venv .venv" in readme
    ignored = (ROOT / ".gitignore").read_text(encoding="utf-8").split()
    assert ".venv/" in ignored


@pytest.mark.unit
def test_readme_installs_nox_into_the_venv_not_the_system_python() -> None:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.DOTALL)
    commands = [ln for block in blocks for ln in block.splitlines() if not ln.lstrip().startswith("#")]
    installs = [c for c in commands if "pip install" in c]
    assert installs and all(re.search(r"(^|\s)\.venv[\w.-]*/bin/(pip|python -m pip) install", c) for c in installs), installs
    assert any("nox" in c and ".venv/bin/python -m nox" in c for c in commands), commands


@pytest.mark.unit
def test_readme_log_rank_0_example_prints_when_logging_is_configured(work: Path) -> None:
    readme = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    [snippet] = [ln.strip() for ln in readme.splitlines() if "logging.basicConfig" in ln and "log_rank_0" in ln]
    code = "import mcore_compat as mc\n" + snippet.split("#")[0].strip().replace("; ", "\n")
    proc = _run([sys.executable, "-P", "-c", code], work, _env())
    assert proc.returncode == 0, proc.stderr
    assert "step 3" in proc.stderr + proc.stdout, (code, proc.stdout, proc.stderr)


# ---- the real release: items 1, 6, 9, 10 ------------------------------------------------------------------------------
def _installed() -> str:
    return str(mcore_compat.detect().version)


@pytest.mark.mcore
def test_a_broken_limit_of_the_release_stops_doctor_and_self_check(tmp_path: Path, work: Path) -> None:
    """The installed release's own limit (setuptools, torch or numpy, from versions.toml) broken by declaring a
    version outside it: doctor exits 1 with the pip command that fixes it, and so does the self-check (3) for a
    limit known to stop the release; a numpy limit (declared, yet known to run) leaves the self-check a note."""
    version = _installed()
    release = mcore_compat.support.status(version).release
    assert release is not None, f"{version} is not listed"
    limits = release.limits()
    broken = next(((name, limits[name], bad) for name, bad in (("setuptools", "84.0.0"), ("torch", "2.5.0"),
                                                                ("numpy", "2.1.0"))
                   if name in limits and not SpecifierSet(limits[name]).contains(bad)), None)
    if broken is None:
        pytest.skip(f"megatron-core {version} has no limit on setuptools, torch or numpy to break")
    name, spec, bad = broken
    shadow = tmp_path / "shadow"
    _dist(shadow, name, bad)
    env = _env(shadow)
    doctor = _cli(work, env, "doctor")
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    _no_traceback(doctor)
    assert f"{name}{spec} is required" in doctor.stdout and f"{name} {bad} is installed" in doctor.stdout
    assert _fix_line(doctor.stdout) == _pip(f"{name}{spec}")
    if name != "numpy":
        check = _cli(work, env, "self-check", "--nproc", "2")
        assert check.returncode == 3 and _fix_line(check.stderr) == _pip(f"{name}{spec}"), check.stderr
        _no_traceback(check)
    else:  # what the self-check's pre-flight decides, without starting the (passing) run
        code = ("from mcore_compat.preflight import require\nr = require()\n"
                "print(r.ok, r.notes[0] if r.notes else '')")
        proc = _run([sys.executable, "-P", "-c", code], work, env)
        assert proc.returncode == 0 and proc.stdout.startswith("True the environment does NOT fit"), proc.stderr
        assert f"{name}{spec} is required" in proc.stdout


@pytest.mark.mcore
@pytest.mark.launcher
def test_timeout_counts_once_the_ranks_are_up_and_prints_the_stacks(work: Path) -> None:
    """``--timeout 12`` is shorter than starting a rank on a loaded machine (torch and Megatron imports) and far
    shorter than 100,000 steps: the rank is stopped while it runs the check, not while it starts, and its stacks
    are printed, labelled, once. (Not shorter: torch imports modules such as sympy lazily during the first step,
    and a stack stopped inside that import chain is deeper than faulthandler's 100 frames, which would cut the
    self-check's own frames off; with two CI sessions on two cores that import was still running after 4 s.)"""
    proc = _cli(work, _env(), "self-check", "--nproc", "1", "--timeout", "12", "--steps", "100000", "--device",
                "cpu")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    _no_traceback(proc)
    assert "rank(s) 0 did not finish within 12 s" in proc.stdout and "did not start" not in proc.stdout
    assert proc.stdout.count("--- rank 0: Python stacks when it was stopped ---") == 1
    stack = proc.stdout.split("--- rank 0: Python stacks when it was stopped ---", 1)[1]
    assert "mcore_compat/selfcheck/" in stack.replace(os.sep, "/"), stack[:3000]
    assert not _PRINTED_WARNING.search(proc.stdout + proc.stderr), proc.stderr[-3000:]


@pytest.mark.mcore
@pytest.mark.launcher
def test_selfcheck_under_torchrun_names_its_world_size_and_summarises_warnings(work: Path) -> None:
    proc = _run([sys.executable, "-P", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                 "mcore_compat", "self-check", "--device", "cpu", "--steps", "1"], work, _env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    _no_traceback(proc)
    [settings] = [ln for ln in proc.stdout.splitlines() if ln.startswith("settings:")]
    assert "nproc=2," in settings and "nproc=None" not in settings, settings
    assert not _PRINTED_WARNING.search(out), out[-5000:]  # no rank prints Megatron's warnings itself
    assert len([ln for ln in proc.stdout.splitlines() if ln.startswith("warnings:")]) <= 1
    assert "()" not in proc.stdout, proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1].startswith("self-check: PASS")


# ---- item 9: the ranks' warnings, merged ----------------------------------------------------------------------------
@pytest.mark.unit
def test_the_ranks_warnings_are_counted_once_and_listed_with_verbose() -> None:
    from mcore_compat.selfcheck import Report
    from mcore_compat.selfcheck.noise import merge

    same = ("FutureWarning", "`torch.cuda.amp.custom_fwd(args...)` is deprecated.", "layers.py:278")
    only_one = ("UserWarning", "pkg_resources is deprecated as an API.", "random.py:10")
    merged = merge([[same, only_one, same], [same]])
    assert merged == [{"category": "FutureWarning", "message": same[1], "where": same[2], "count": 3, "ranks": [0, 1]},
                      {"category": "UserWarning", "message": only_one[1], "where": only_one[2], "count": 1,
                       "ranks": [0]}]
    report = Report(warnings=merged)
    short = report.render()
    assert short.splitlines()[0].startswith("warnings: 2 distinct on the ranks (4 in all") and same[1] not in short
    full = report.render(verbose=True).splitlines()
    assert sum(same[1] in line for line in full) == 1 and sum(only_one[1] in line for line in full) == 1
    assert any(line.startswith("  FutureWarning at layers.py:278 (ranks 0, 1): ") for line in full), full


@pytest.mark.unit
def test_weight_decay_coupling_reaches_the_self_check_options() -> None:
    """``--no-decoupled-weight-decay`` asks for Adam with L2 decay through the moments (the sweep proves that such a
    run passes on 0.15+, tests/test_selfcheck_real.py); the default stays decoupled (AdamW)."""
    from mcore_compat.cli import build_parser
    from mcore_compat.cli.selfcheck import _options

    parser = build_parser()
    assert _options(parser.parse_args(["self-check"])).decoupled_weight_decay is True
    coupled = _options(parser.parse_args(["self-check", "--no-decoupled-weight-decay", "--weight-decay", "0.05"]))
    assert coupled.decoupled_weight_decay is False and coupled.weight_decay == 0.05


@pytest.mark.unit
def test_the_sweep_names_each_configuration_before_its_report(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Seven reports whose settings lines differ at the far right are told apart by a header naming each
    configuration (the runs themselves are the matrix's CLI self-check; here only what is printed)."""
    import mcore_compat.selfcheck as selfcheck
    from mcore_compat.cli import build_parser
    from mcore_compat.selfcheck import Report, SelfCheckOptions

    configs = [SelfCheckOptions(tp=2, sequence_parallel=True, dropout=0.1, dtype="bf16"),
               SelfCheckOptions(pp=2, tie_embeddings=True)]
    monkeypatch.setattr(selfcheck, "standard_sweep", lambda *a, **k: (configs, [("moe", "no experts here")]))
    monkeypatch.setattr(selfcheck, "run_sweep", lambda cs, *a, **k: [Report(settings={"n": i}) for i in range(len(cs))])
    args = build_parser().parse_args(["self-check", "--sweep"])
    from mcore_compat.cli.selfcheck import _options, _sweep

    _sweep(args, _options(args))
    lines = capsys.readouterr().out.splitlines()
    assert [ln for ln in lines if ln.startswith("== ")] == [
        f"== configuration 1/2: {configs[0].label()} ==", f"== configuration 2/2: {configs[1].label()} =="]
    assert "not run: moe: no experts here" in lines


# ---- every command: a closed pipe, and --help that says what each option means and its default -------------------
def _all_parsers() -> list[tuple[str, object]]:
    """Every (sub)command's parser: ``mcore-compat ...`` and ``python -m mcore_compat.support ...``."""
    import argparse

    from mcore_compat.cli import build_parser
    from mcore_compat.support.cli import _build_parser

    found: list[tuple[str, object]] = []

    def walk(name: str, parser: argparse.ArgumentParser) -> None:
        found.append((name, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, p in action.choices.items():
                    walk(f"{name} {sub}", p)

    walk("mcore-compat", build_parser())
    walk("python -m mcore_compat.support", _build_parser())
    return found


@pytest.mark.unit
def test_every_option_of_every_command_says_what_it_means_and_its_default() -> None:
    """Each option's help says what it does; each option that takes a value (or has a --no- form) names its
    default; ``--help`` of every command shows them."""
    import argparse

    missing = []
    for name, parser in _all_parsers():
        assert isinstance(parser, argparse.ArgumentParser)
        shown = parser.format_help()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            text = action.help or ""
            flag = action.option_strings[-1] if action.option_strings else action.dest
            if not text.strip():
                missing.append(f"{name} {flag}: no help")
            elif action.option_strings and action.nargs != 0 and "default" not in text:
                missing.append(f"{name} {flag}: no default in {text!r}")
            elif " ".join(text.split()[:3]) not in " ".join(shown.split()):
                missing.append(f"{name} {flag}: not in --help")
    assert not missing, "\n".join(missing)
    assert len(_all_parsers()) >= 9


_PIPED_COMMANDS = {
    "doctor": ["-m", "mcore_compat", "doctor"],
    "doctor --json": ["-m", "mcore_compat", "doctor", "--json"],
    "checkpoint inspect --json": ["-m", "mcore_compat", "checkpoint", "inspect", "--json",
                                  str(ROOT / "tests" / "data" / "checkpoints" / "0.16.1" / "checkpoint")],
    "scan": ["-m", "mcore_compat", "scan", str(ROOT / "examples")],
    "self-check --help": ["-m", "mcore_compat", "self-check", "--help"],
    "support list": ["-m", "mcore_compat.support", "list"],
}


@pytest.mark.unit
@pytest.mark.parametrize("command", sorted(_PIPED_COMMANDS))
def test_a_closed_pipe_ends_the_command_quietly(command: str, work: Path) -> None:
    """``mcore-compat ... | head``: the reader is gone before the command writes; no traceback, no "Exception
    ignored", exit status 141 (128 + SIGPIPE, as a shell reports for coreutils; argparse's --help swallows the
    error itself and exits 0)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-P", *_PIPED_COMMANDS[command]], stdout=write,
                              stderr=subprocess.PIPE, text=True, cwd=work, env=_env(), timeout=_TIMEOUT, check=False)
    finally:
        os.close(write)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == (0 if command.endswith("--help") else 141), (proc.returncode, proc.stderr[-3000:])
