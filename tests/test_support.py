"""The support matrix (mcore_compat.support), the generated nox sessions and the CI script. No megatron needed."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

from mcore_compat import support
from mcore_compat.support import Matrix, Release

ROOT = Path(__file__).resolve().parents[1]
MATRIX_DIR = ROOT / "matrix"

#: The latest patch of each minor on PyPI when this was written (the earliest is always X.Y.0).
_LATEST_PATCH = {"0.12": "0.12.3", "0.13": "0.13.1", "0.15": "0.15.3", "0.16": "0.16.1", "0.17": "0.17.1",
                 "0.18": "0.18.2", "0.19": "0.19.2"}


@pytest.fixture(scope="module")
def source_matrix() -> Matrix:
    """The matrix of this source tree (not the installed copy, which may be older)."""
    return Matrix(MATRIX_DIR)


@pytest.fixture(scope="module")
def rels(source_matrix: Matrix) -> list[Release]:
    return source_matrix.releases()


def _by_version(rels: list[Release]) -> dict[str, Release]:
    return {str(r.version): r for r in rels}


# ------------------------------------------------------------------------------------------- versions.toml
def test_releases_are_parsed_sorted_and_unique(rels: list[Release]) -> None:
    versions = [r.version for r in rels]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert all(isinstance(v, Version) for v in versions)
    assert str(versions[0]) == "0.4.0" and str(versions[-1]) == "0.19.2"


def test_installed_package_data_matches_the_source_tree(rels: list[Release]) -> None:
    """The installed mcore_compat.matrix (or the source fallback) lists the same releases."""
    assert [r.version for r in support.releases()] == [r.version for r in rels]


@pytest.mark.parametrize("minor", range(4, 20))
def test_every_minor_has_its_earliest_and_latest_patch(rels: list[Release], minor: int) -> None:
    key = f"0.{minor}"
    same = [r for r in rels if r.minor == key]
    assert same, f"minor {key} is not listed"
    assert str(same[0].version) == f"{key}.0", f"the earliest patch {key}.0 is not listed"
    assert str(same[-1].version) == _LATEST_PATCH.get(key, f"{key}.0")
    assert "min" in same[0].tags and "latest" in same[-1].tags
    assert all("min" not in r.tags for r in same[1:]) and all("latest" not in r.tags for r in same[:-1])


def test_python_and_tags(rels: list[Release]) -> None:
    for r in rels:
        want = "3.12" if r.version >= Version("0.17") else "3.11"
        assert r.python == want, r.version
        assert "cpu" in r.tags and ("py312" if want == "3.12" else "py311") in r.tags
        assert r.session == f"mcore-{r.version}"
    assert "oldest" in rels[0].tags and "newest" in rels[-1].tags
    assert sum("oldest" in r.tags for r in rels) == 1 and sum("newest" in r.tags for r in rels) == 1


def test_limits(rels: list[Release]) -> None:
    for r in rels:
        if Version("0.5") <= r.version < Version("0.9"):
            assert r.setuptools == "<81", r.version
        if Version("0.13") <= r.version < Version("0.16"):
            assert r.numpy == "<2", r.version
        if r.version >= Version("0.17"):
            assert r.requires_python == ">=3.12", r.version
    assert _by_version(rels)["0.16.1"].limits() == {"requires_python": ">=3.10", "torch": ">=2.6.0"}


def test_0_4_0_is_unpacked_from_the_cp310_wheel(rels: list[Release]) -> None:
    r = _by_version(rels)["0.4.0"]
    assert r.install == "unpack-wheel" and r.wheel_python == "3.10"
    assert all(x.install == "wheel" for x in rels[1:])


def test_every_release_fits_its_base(source_matrix: Matrix, rels: list[Release]) -> None:
    """What the noxfile checks at run time, checked against the base requirements' pins."""
    for r in rels:
        base = " ".join(source_matrix.base_requirements(r.python))
        if r.numpy:
            assert "numpy<2" in base, f"{r.version} needs numpy{r.numpy}, the {r.python} base has {base}"
        if r.setuptools:
            assert "setuptools<81" in base, f"{r.version} needs setuptools{r.setuptools}"


def test_unmet_limits() -> None:
    r = Release(version=Version("0.14.0"), python="3.11", requires_python=">=3.10", numpy="<2", torch=">=2.6")
    assert r.unmet_limits("3.11.7", {"numpy": "1.26.4", "torch": "2.13.0+cpu"}) == []
    problems = r.unmet_limits("3.9.1", {"numpy": "2.1.0", "torch": None})
    assert len(problems) == 3 and any("numpy<2" in p and "2.1.0" in p for p in problems)


def test_fit_names_the_broken_limit_and_the_pip_command_that_fixes_it(rels: list[Release]) -> None:
    by = _by_version(rels)
    env = {"torch": "2.13.0+cpu", "numpy": "1.26.4", "setuptools": "84.2.1"}
    bad = support.fit(by["0.8.0"], releases=rels, python="3.11.7", installed=env, python_exe="/v/bin/python")
    assert not bad.ok and [m.name for m in bad.misfits] == ["setuptools"]
    assert "setuptools<81 is required" in bad.summary() and "setuptools 84.2.1 is installed" in bad.summary()
    assert bad.fix == "/v/bin/python -m pip install 'setuptools<81'"
    good = support.fit(by["0.8.0"], releases=rels, python="3.11.7", installed={**env, "setuptools": "80.9.0"})
    assert good.ok and good.fix is None and good.summary() == "fits the limits of 0.8.0 (setuptools<81)"
    two = support.fit(by["0.13.0"], releases=rels, python="3.11.7", installed={**env, "numpy": "2.1.0"},
                      python_exe="py")
    assert two.fix == "py -m pip install 'numpy<2'"
    assert [m.blocking for m in bad.misfits + two.misfits] == [True, False]  # numpy<2 is declared, not needed
    # a Python the release does not accept: no pip command fixes the interpreter, so name the release for it
    py = support.fit(by["0.19.2"], releases=rels, python="3.11.7", installed=env, python_exe="py")
    assert [m.name for m in py.misfits] == ["python"]
    assert py.fix is not None and py.fix.startswith("py -m pip install megatron-core==0.16.1")
    assert "Python >=3.12 with megatron-core==0.19.2" in py.fix
    # torch is needed by every release, limit or not
    no_torch = support.fit(by["0.9.0"], releases=rels, python="3.11.7", installed={**env, "torch": None},
                           python_exe="py")
    assert no_torch.fix == "py -m pip install torch" and "torch is not installed" in no_torch.summary()
    assert support.newest_for_python(rels, "3.12.1").version == Version("0.19.2")
    assert support.newest_for_python(rels, "3.13.0").version == Version("0.19.2")


def test_base_requirements() -> None:
    reqs = support.base_requirements("3.11")
    assert "numpy<2" in reqs and any(r.startswith("torch") for r in reqs)
    assert support.base_requirements("3.11.7") == reqs == support.base_requirements("py311")
    with pytest.raises(KeyError):
        support.base_requirements("3.9")


def test_bad_toml_is_refused(tmp_path: Path) -> None:
    (tmp_path / "versions.toml").write_text('[base."3.11"]\nrequirements = []\n[[release]]\nversion = "0.16.1"\n'
                                            'python = "3.11"\nnumbpy = "<2"\n')
    with pytest.raises(ValueError, match="unknown keys"):
        Matrix(tmp_path).releases()


# ------------------------------------------------------------------------------------------- status
def test_status_of_a_listed_release() -> None:
    st = support.status("0.16.1")
    assert st.listed and st.level == "listed" and st.release is not None
    assert "supported release" in st.summary()
    assert json.loads(json.dumps(st.as_dict()))["listed"] is True


@pytest.mark.parametrize(
    ("version", "level", "older", "newer"),
    [
        ("0.20.0+abc", "newer", "0.19.2", None),
        ("0.16.0rc1", "minor-listed", "0.15.3", "0.16.0"),
        ("0.16.0.dev0", "minor-listed", "0.15.3", "0.16.0"),
        ("0.3.0", "older", None, "0.4.0"),
        ("0.12.1", "minor-listed", "0.12.0", "0.12.3"),
        ("0.16.1+local", "local-build", "0.16.0", "0.17.0"),
    ],
)
def test_status_of_unlisted_versions(version: str, level: str, older: str | None, newer: str | None) -> None:
    st = support.status(version)
    assert not st.listed and st.level == level, st.summary()
    assert (str(st.nearest_older.version) if st.nearest_older else None) == older
    assert (str(st.nearest_newer.version) if st.nearest_newer else None) == newer
    assert st.newer_than_newest is (level == "newer") and st.older_than_oldest is (level == "older")
    assert version in st.summary() and st.results == {}


def test_status_names_the_minors_releases() -> None:
    st = support.status("0.15.1")
    assert [str(r.version) for r in st.minor_releases] == ["0.15.0", "0.15.3"] and "0.15.3" in st.summary()


# ------------------------------------------------------------------------------------------- results + README
def _copy_matrix(tmp_path: Path) -> Path:
    target = tmp_path / "matrix"
    target.mkdir()
    (target / "versions.toml").write_text((MATRIX_DIR / "versions.toml").read_text())
    return target


def test_record_result_and_render(tmp_path: Path) -> None:
    target = _copy_matrix(tmp_path)
    entry = support.record_result("0.16.1", "cpu", {"result": "pass", "python": "3.11.7", "torch": "2.13.0",
                                                    "passed": 12, "skipped": 1, "details": ""}, path=target)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", entry["date"])
    support.record_result("0.4.0", "gpu", {"result": "fail", "date": "2025-01-02", "checks": {"ddp": "fail"},
                                           "details": "x | y"}, path=target)
    m = Matrix(target, results_dir=target)
    assert m.results()["0.16.1"]["cpu"]["passed"] == 12
    assert m.status("0.16.1").results["cpu"]["result"] == "pass"
    assert list(json.loads((target / "results.json").read_text())["results"]) == ["0.4.0", "0.16.1"]
    table = m.render_table()
    assert f"pass ({entry['date']}): 12 passed, 1 skipped" in table and "fail (2025-01-02)" in table
    assert m.write_readme().read_text() == table


@pytest.mark.parametrize(("args", "match"), [
    (("0.20.0", "cpu", {"result": "pass"}), "not a listed release"),
    (("0.16.1", "tpu", {"result": "pass"}), "kind must be"),
    (("0.16.1", "cpu", {"result": "ok"}), "must be one of"),
])
def test_record_result_is_strict(tmp_path: Path, args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        support.record_result(*args, path=_copy_matrix(tmp_path))


def test_render_table_lists_every_version(rels: list[Release], source_matrix: Matrix) -> None:
    table = source_matrix.render_table()
    for r in rels:
        assert re.search(rf"^\| {re.escape(str(r.version))} \|", table, re.M), r.version
    assert "setuptools<81" in table and "numpy<2" in table and "python>=3.12" in table


def test_committed_readme_is_up_to_date(source_matrix: Matrix) -> None:
    readme = MATRIX_DIR / "README.md"
    assert readme.read_text() == source_matrix.render_table(), (
        "matrix/README.md is stale: run `python -m mcore_compat.support render`")


def test_cli_status_and_render_check() -> None:
    out = subprocess.run([sys.executable, "-m", "mcore_compat.support", "--matrix-dir", str(MATRIX_DIR),
                          "status", "0.3.0", "--json"], capture_output=True, text=True)
    assert out.returncode == 1 and json.loads(out.stdout)["level"] == "older"
    out = subprocess.run([sys.executable, "-m", "mcore_compat.support", "--matrix-dir", str(MATRIX_DIR),
                          "render", "--check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


# ------------------------------------------------------------------------------------------- noxfile + CI
def _load_noxfile_with(fake_nox: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The noxfile, loaded with a stand-in nox; it puts the repository on sys.path (for ``ci``): undone after."""
    monkeypatch.setitem(sys.modules, "nox", fake_nox)
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("_noxfile_under_test", ROOT / "noxfile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _fake_nox() -> tuple[types.ModuleType, dict[str, dict[str, Any]]]:
    """A stand-in for nox that records the sessions the noxfile declares."""
    registered: dict[str, dict[str, Any]] = {}

    def session(func: Any = None, /, **kwargs: Any) -> Any:
        def register(f: Any) -> Any:
            registered[kwargs.get("name") or f.__name__] = {"func": f, **kwargs}
            return f
        return register(func) if func is not None else register

    fake = types.ModuleType("nox")
    fake.session = session  # type: ignore[attr-defined]
    fake.options = types.SimpleNamespace()  # type: ignore[attr-defined]
    fake.Session = object  # type: ignore[attr-defined]
    return fake, registered


def test_nox_sessions_equal_the_releases(rels: list[Release], monkeypatch: pytest.MonkeyPatch) -> None:
    fake, registered = _fake_nox()
    _load_noxfile_with(fake, monkeypatch)
    release_sessions = {n for n in registered if n.startswith("mcore-")}
    assert release_sessions == {r.session for r in rels}
    assert {"unit", "lint", "matrix"} <= set(registered)
    for r in rels:
        s = registered[r.session]
        assert s["venv_backend"] == "none" and set(r.tags) <= set(s["tags"]), r.version
        assert s["requires"] == [f"base-{r.python}"] and f"base-{r.python}" in registered, r.version
    assert all(registered[n]["venv_backend"] == "none" for n in ("unit", "lint", "matrix"))


def test_real_nox_lists_a_session_per_release(rels: list[Release]) -> None:
    if importlib.util.find_spec("nox") is None:
        pytest.skip("nox is not installed in this interpreter (the stand-in test covers the session list)")
    out = subprocess.run([sys.executable, "-m", "nox", "-l", "-f", str(ROOT / "noxfile.py")], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    listed = set(re.findall(r"^[*-] (mcore-\S+)", out.stdout, re.M))
    assert listed == {r.session for r in rels}


def test_matrix_summary_line(monkeypatch: pytest.MonkeyPatch) -> None:
    fake, _ = _fake_nox()
    nf = _load_noxfile_with(fake, monkeypatch)
    res = nf.results
    results = [res.JobResult("a", ok=True, passed=10, skipped=2), res.JobResult("b", ok=False, failed=1, passed=3),
               res.JobResult("lint", ok=False, errors=1)]
    assert res.summary_line(results, 12.345) == "==== 1 failed, 13 passed, 2 skipped, 1 error in 12.35s ===="
    assert res.summary_line([], 1.0) == "==== no tests ran in 1.00s ===="


def test_junit_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake, _ = _fake_nox()
    nf = _load_noxfile_with(fake, monkeypatch)
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite tests="5" failures="1" errors="1" skipped="1">'
                   '<testcase classname="t.m" name="ok"/><testcase classname="t.m" name="bad"><failure/></testcase>'
                   "</testsuite></testsuites>")
    res = nf.results.JobResult("x")
    nf.results.junit_counts(xml, res)
    assert (res.passed, res.failed, res.errors, res.skipped) == (2, 1, 1, 1) and "t.m::bad" in res.details


@pytest.mark.parametrize(("code", "ok"), [(0, True), (1, False), (5, False)])
def test_a_pytest_run_that_collected_nothing_fails(code: int, ok: bool, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """pytest's exit status 5 (no test collected) fails the session and counts as an error in the matrix."""
    fake, _ = _fake_nox()
    nf = _load_noxfile_with(fake, monkeypatch)
    env = nf.matrix_env.MatrixEnv(nf.matrix_env.Layout(tmp_path), nf.ENV.matrix)
    monkeypatch.setattr(nf.Out, "run", lambda self, argv, env=None, check=True, cwd=None: code)
    result, out = nf.results.JobResult("unit"), nf.Out(tmp_path / "unit.log")
    nf.jobs.run_pytest(env, "3.11", None, "not mcore", out, result, ())
    out.close()
    assert result.ok is ok
    assert result.errors == (0 if ok else 1)
    if code == 5:
        assert "collected no test" in result.details
        assert "ERROR: pytest collected no test" in (tmp_path / "unit.log").read_text()
        assert nf.results.summary_line([result], 1.0) == "==== 1 error in 1.00s ===="
        errors: list[str] = []
        session = types.SimpleNamespace(error=errors.append, log=lambda text: None)
        nf._finish(session, result)
        assert errors == [f"unit failed: {result.details}"]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", text, re.S)
    return [b.strip().removeprefix("$ ") for b in blocks]


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run runs exactly README.md's second command (the test command)."""
    if not (ROOT / "README.md").is_file():
        pytest.skip("no README.md")
    commands = _readme_commands()
    assert len(commands) >= 2, "README.md should open with the install command and the test command"
    ci = (ROOT / ".ci" / "run").read_text()
    marked = re.search(r"^# README test command.*\n(.*)$", ci, re.M)
    assert marked, ".ci/run should mark the README test command with '# README test command'"
    assert marked.group(1).strip() == commands[1]
    assert "nox -s matrix" in commands[1]


def test_faults_cell_shows_the_fault_detection_score() -> None:
    from mcore_compat.support.render import _faults_cell

    assert _faults_cell(None) == "—"
    assert _faults_cell({"result": "pass"}) == "—"
    assert _faults_cell({"fault_detection": {"caught": 28, "faults": 28, "clean": 7, "clean_pass": 7}}) == \
        "28/28 (100 %)"
    assert _faults_cell({"fault_detection": {"caught": 20, "faults": 24, "clean": 7, "clean_pass": 6}}) == \
        "20/24 (83 %); clean 6/7"


def _session_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, session: str,
                     reports: dict[str, Any]) -> tuple[Any, Any, dict[str, str]]:
    """Run ``jobs.run_pytest`` for ``session`` with pytest replaced by a stand-in that writes each
    ``{environment variable: payload}`` of ``reports`` as JSON to the file the variable names; returns the noxfile
    module, the job's result and the environment pytest got."""
    fake, _ = _fake_nox()
    nf = _load_noxfile_with(fake, monkeypatch)
    env = nf.matrix_env.MatrixEnv(nf.matrix_env.Layout(tmp_path), nf.ENV.matrix)
    seen: dict[str, str] = {}

    def fake_pytest(self: Any, argv: list[str], env: dict[str, str] | None = None, check: bool = True,
                    cwd: Any = None) -> int:
        assert env is not None
        seen.update(env)
        for name, payload in reports.items():
            Path(env[name]).write_text(json.dumps(payload))
        return 0

    monkeypatch.setattr(nf.Out, "run", fake_pytest)
    result, out = nf.results.JobResult(session), nf.Out(tmp_path / "s.log")
    nf.jobs.run_pytest(env, "3.11", None, "mcore", out, result, ())
    out.close()
    return nf, result, seen


def test_the_fault_score_the_suite_writes_is_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The session points the fault-injection suite at a file (MCORE_COMPAT_FAULT_REPORT); its score goes into
    the CPU record (and from there into the support table's 'faults caught' column)."""
    nf, result, seen = _session_writing(tmp_path, monkeypatch, "mcore-0.16.1", {"MCORE_COMPAT_FAULT_REPORT": {
        "caught": 27, "faults": 28, "clean_pass": 7, "clean": 7, "details": {}}})
    assert seen["MCORE_COMPAT_FAULT_REPORT"] == str(tmp_path / ".cache" / "logs" / "mcore-0.16.1.faults.json")
    assert result.faults == {"caught": 27, "faults": 28, "clean_pass": 7, "clean": 7}
    assert nf.results.cpu_record("wheel", result)["fault_detection"] == result.faults
    # no Megatron-fault score written (an older suite): nothing recorded, the table shows "—"
    assert nf.results.cpu_record("wheel", result)["megatron_fault_detection"] is None


def test_the_megatron_fault_score_is_recorded_and_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/test_megatron_faults.py writes its score to MCORE_COMPAT_MEGATRON_FAULT_REPORT; the CPU record keeps
    it and the support table shows caught/acting (not acting apart); records without it show "—"."""
    from mcore_compat.support.render import _megatron_faults_cell

    score = {"caught": 7, "acting": 7, "not_acting": 12, "faults": 19, "clean_pass": 4, "clean": 4}
    nf, result, _ = _session_writing(tmp_path, monkeypatch, "mcore-0.4.0",
                                     {"MCORE_COMPAT_MEGATRON_FAULT_REPORT": {**score, "details": {}}})
    record = nf.results.cpu_record("wheel", result)
    assert record["megatron_fault_detection"] == score
    assert _megatron_faults_cell(record) == "7/7; 12 not acting"
    assert _megatron_faults_cell({**record, "megatron_fault_detection": {**score, "caught": 6, "clean_pass": 3}}) \
        == "6/7; 12 not acting; clean 3/4"
    assert _megatron_faults_cell({"result": "pass", "fault_detection": {"caught": 1, "faults": 1}}) == "—"
    assert _megatron_faults_cell(None) == "—"


def test_the_fault_suites_run_in_the_latest_patch_of_each_minor(rels: list[Release]) -> None:
    """Tests marked ``faults`` run in the session of each minor's latest listed patch (and the launcher tests in the
    sessions tagged ``launcher``); an earlier patch's row in the support table names the patch that ran them."""
    from ci.jobs import session_marker
    from mcore_compat.support.render import render

    for r in rels:
        latest = max(o.version for o in rels if o.minor == r.minor)
        marker = session_marker(r)
        assert ("not faults" in marker) == (r.version != latest), (r.version, marker)
        assert ("not launcher" in marker) == ("launcher" not in r.tags), (r.version, marker)
    earlier = [r for r in rels if "latest" not in r.tags]
    assert earlier, "no minor lists two patches: the rule is not exercised"
    table = render(rels, {}, {})
    for r in earlier:
        [row] = [line for line in table.splitlines() if line.startswith(f"| {r.version} |")]
        latest = max(o.version for o in rels if o.minor == r.minor)
        assert row.count(f"run on {latest} (the minor's latest patch)") == 2, row


def test_the_time_table_is_rendered_from_the_recorded_timing() -> None:
    """matrix/README.md shows where each release session's time went, from the CPU record's ``timing``."""
    from mcore_compat.support.render import _timing_row

    record = {"seconds": 150.4, "timing": {
        "prepare": 3.0, "startup": 0.3, "pytest": 120.2, "selfcheck": 20.6, "collect": 2.5,
        "rank_starts": [{"nprocs": 2, "method": "forkserver", "seconds": 8.2, "import_seconds": 0.0},
                        {"nprocs": 4, "method": "spawn", "seconds": 11.0, "import_seconds": 6.5}],
        "subprocesses": {"count": 6, "seconds": 30.4},
        "slowest_modules": {"tests/test_selfcheck_real.py": 40.2, "tests/test_cli.py": 20.0}}}
    assert _timing_row("0.16.1", record) == (
        "| 0.16.1 | 150 | 3 | 120 | 2 | 2 forked 8.2 s, 4 spawned 11.0 s | 6: 30 s | 21 | "
        "test_selfcheck_real.py 40, test_cli.py 20 |")
    assert _timing_row("0.16.1", {"seconds": 1.0}) is None and _timing_row("0.16.1", None) is None


def test_docs_session_builds_the_site_strictly_with_pinned_tools(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``nox -s docs`` and the matrix's ``docs`` job: ``mkdocs build --strict`` with the tools that
    ci/matrix_env.py pins (installed into ``.cache/docs-venv`` by the machinery itself, so a fresh CI machine
    builds the site), which pyproject's ``docs`` extra repeats."""
    import tomllib

    from ci import jobs, matrix_env, scheduler

    fake, registered = _fake_nox()
    nf = _load_noxfile_with(fake, monkeypatch)
    assert registered["docs"]["default"] is False and registered["docs"]["venv_backend"] == "none"
    env = matrix_env.MatrixEnv(matrix_env.Layout(tmp_path), nf.ENV.matrix)
    monkeypatch.setattr(matrix_env, "find_python", lambda python: "/fake/python")
    seen: list[list[str]] = []

    def run(self: object, argv: list[object], env: object = None, check: bool = True, cwd: object = None) -> int:
        args = [str(a) for a in argv]
        seen.append(args)
        if args[1:3] == ["-m", "venv"]:
            (Path(args[3]) / "bin").mkdir(parents=True)
            (Path(args[3]) / "bin" / "python").write_text("")
        return 0

    monkeypatch.setattr(matrix_env.Out, "run", run)
    for _ in range(2):  # the second run finds the stamped venv
        res = jobs.run_docs(env, matrix_env.Out())
        assert res.ok and res.name == "docs"
    venv = str(tmp_path / ".cache" / "docs-venv")
    assert seen[0] == ["/fake/python", "-m", "venv", venv]
    assert seen[1] == [f"{venv}/bin/python", "-m", "pip", "install", *matrix_env.DOCS_TOOLS]
    build = [f"{venv}/bin/python", "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / ".cache" / "site")]
    assert seen[2:] == [build, build]
    monkeypatch.setattr(matrix_env.Out, "run", lambda *a, **k: 1)
    res = jobs.run_docs(env, matrix_env.Out())
    assert not res.ok and res.errors == 1 and "mkdocs build --strict exited with status 1" in res.details
    # the matrix runs it (a light job, started last, in parallel with the release sessions)
    names: list[str] = []
    monkeypatch.setattr(scheduler, "run_jobs", lambda e, job_list, parallel: names.extend(j.name for j in job_list)
                        or [])
    monkeypatch.setattr(scheduler, "report", lambda *a: [])
    env.matrix = types.SimpleNamespace(releases=lambda: [], write_readme=lambda: tmp_path / "README.md")
    scheduler.run_matrix(env, ["--no-record"], lambda line: None)
    assert names == ["unit", "lint", "docs"]
    assert all("==" in tool for tool in matrix_env.DOCS_TOOLS)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["docs"] == list(matrix_env.DOCS_TOOLS)
    sybil = [t for t in matrix_env.TEST_TOOLS if t.startswith("sybil")]
    assert sybil and all(set(sybil) <= set(extras[e]) for e in ("test", "dev"))
    config = (ROOT / "mkdocs.yml").read_text()
    assert "strict: true" in config and "docs_dir: docs" in config


def test_docs_pages_link_only_to_pages_of_the_site() -> None:
    """mkdocs --strict fails on a relative link that leaves docs/ (e.g. ``../benchmarks/README.md``): every
    relative link of docs/*.md names a page or file under docs/."""
    import re

    docs = ROOT / "docs"
    for page in sorted(docs.glob("*.md")):
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" not in target and not target.startswith("mailto:"):
                resolved = (docs / target).resolve()
                assert resolved.is_relative_to(docs) and resolved.exists(), f"{page.name}: {target}"


def test_the_checkpoint_loads_are_recorded_and_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/test_checkpoint_cross.py writes the loads of the committed checkpoints to
    MCORE_COMPAT_CHECKPOINT_REPORT; the CPU record keeps them and the support table's 'loads checkpoints of' shows
    the saving releases' span, naming those that did not load exactly; records without them show "—"."""
    from mcore_compat.support.render import _checkpoints_cell

    loads = {v: {"full": "exact", "weights": "exact"} for v in ("0.12.3", "0.4.0", "0.19.2")}
    nf, result, _ = _session_writing(tmp_path, monkeypatch, "mcore-0.10.0",
                                     {"MCORE_COMPAT_CHECKPOINT_REPORT": {"release": "0.10.0", "loads": loads}})
    record = nf.results.cpu_record("wheel", result)
    assert record["checkpoint_cross"] == loads
    assert _checkpoints_cell(record) == "0.4.0-0.19.2: exact"
    refused = {**loads, "0.4.0": {"full": "refused: CheckpointMismatchError: x", "weights": "exact"}}
    assert _checkpoints_cell({"checkpoint_cross": refused}) == \
        "0.4.0-0.19.2: 2/3 exact; 0.4.0 weights exact; optimizer refused"
    assert _checkpoints_cell({"result": "pass"}) == "—" and _checkpoints_cell(None) == "—"


def test_the_generated_settings_counts_are_recorded_and_shown(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/test_generated_settings.py writes its examples per property to MCORE_COMPAT_GENERATED_REPORT; the CPU
    record keeps them and the support table's 'generated settings' shows them, marking a failed property."""
    from mcore_compat.support.render import _generated_cell

    score = {"examples": {"schedule": 12, "invalid": 72, "update": 10}, "failed": ["update"]}
    nf, result, _ = _session_writing(tmp_path, monkeypatch, "mcore-0.10.0",
                                     {"MCORE_COMPAT_GENERATED_REPORT": score})
    record = nf.results.cpu_record("wheel", result)
    assert record["generated_settings"] == score
    assert _generated_cell(record) == "schedule 12, invalid 72, update 10 FAILED"
    assert _generated_cell({"result": "pass"}) == "—" and _generated_cell(None) == "—"
    # the drawn examples compared with the reference release's record
    compared = {**score, "reference_release": "0.16.1", "reference": {
        "schedule": {"compared": 12, "not comparable": 0, "missing": 0, "drawn": 12},
        "update": {"compared": 4, "not comparable": 6, "missing": 0, "drawn": 10}}}
    assert _generated_cell({"generated_settings": compared}) == \
        "schedule 12, invalid 72, update 10 FAILED; 16/22 drawn compared with 0.16.1"
