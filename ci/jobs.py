"""The bodies of the sessions: ``unit``, ``lint``, ``docs`` and one release (start-up check, pytest, self-check).

Each returns a :class:`~ci.results.JobResult` instead of raising, so the matrix can run them side by side and a
single session can fail with the result's details.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ci.matrix_env import MatrixEnv, Release
from ci.output import JobError, Out
from ci.results import JobResult, junit_counts

#: What pytest collects in every session: the suite and the PPO-actor example client (a real client).
TEST_PATHS = ("tests", "examples/ppo_actor/tests", "examples/ray_rl/tests", "README.md", "docs")  # *.md: the root conftest.py (Sybil)
#: pytest's exit status when it collected no test: the session fails (and counts as an error in the matrix).
PYTEST_NO_TESTS = 5
#: The versions.toml tag (and pytest marker) of the release sessions that also run the launcher tests.
LAUNCHER_TAG = "launcher"
#: The pytest marker of the fault-injection suites (tests/test_megatron_faults.py, the self-check's injected faults in
#: tests/test_selfcheck_real.py) and the computed versions.toml tag of the release sessions that run them: the latest
#: listed patch of each minor (see versions.toml's header).
FAULTS_MARKER, FAULTS_TAG = "faults", "latest"
#: What every release session runs after pytest: the main job, as a user runs it.
SELFCHECK_ARGS = ("self-check", "--nproc", "2", "--sweep", "--device", "cpu", "--bind", "--timeout", "600")
#: What the lint session type-checks (paths relative to the repository).
MYPY_PATHS = ("mcore_compat", "patches", "ci")
_STARTUP_CHECK = Path(__file__).resolve().parent / "startup_check.py"
_SELFCHECK_KEYS = ("tp", "pp", "dp", "vpp", "sequence_parallel", "tie_embeddings", "overlap", "experts", "ep",
                   "distributed_optimizer", "bind", "dtype", "dropout", "bias")
#: What a job turns into a failed result instead of raising.
_JOB_ERRORS = (JobError, subprocess.CalledProcessError, OSError)


def _timed(name: str, out: Out, body: Callable[[JobResult], None]) -> JobResult:
    """Run ``body`` on a fresh result; an expected error fails the result (as an error unless pytest ran)."""
    result = JobResult(name=name, log=out.log)
    start = time.monotonic()
    try:
        body(result)
    except _JOB_ERRORS as exc:
        out.say(f"ERROR: {exc}")
        result.ok, result.details = False, str(exc)
        result.errors += 0 if result.ran_pytest else 1
    result.seconds = time.monotonic() - start
    return result


def run_pytest(env: MatrixEnv, python: str, release: Release | None, marker: str, out: Out, result: JobResult,
               extra: Sequence[str]) -> None:
    """Run pytest on :data:`TEST_PATHS` with ``-m marker``; its counts, faults score and verdict go to ``result``.

    The JUnit file, the fault-injection scores (``MCORE_COMPAT_FAULT_REPORT``: faults where mcore_compat acts;
    ``MCORE_COMPAT_MEGATRON_FAULT_REPORT``: faults inside Megatron-Core), the committed checkpoints of other
    releases loaded on this one (``MCORE_COMPAT_CHECKPOINT_REPORT``: tests/test_checkpoint_cross.py), the
    generated settings' case counts (``MCORE_COMPAT_GENERATED_REPORT``: tests/test_generated_settings.py) and where the
    session's time went
    (``MCORE_COMPAT_TIMING_REPORT``, into ``result.timing["inside_pytest"]``) go to ``.cache/logs/<result.name>.*``. Exit status 5 (no test collected) fails the job.

    Args:
        env: the environments.
        python: the base to run on.
        release: the release on ``PYTHONPATH`` (``None``: none).
        marker: the ``-m`` expression.
        out: the job's output.
        result: updated in place.
        extra: more pytest arguments.
    """
    logs = env.layout.logs
    logs.mkdir(parents=True, exist_ok=True)
    junit = logs / f"{result.name}.junit.xml"
    junit.unlink(missing_ok=True)
    faults = logs / f"{result.name}.faults.json"
    faults.unlink(missing_ok=True)
    megatron_faults = logs / f"{result.name}.megatron-faults.json"
    megatron_faults.unlink(missing_ok=True)
    checkpoints = logs / f"{result.name}.checkpoints.json"
    checkpoints.unlink(missing_ok=True)
    generated = logs / f"{result.name}.generated.json"
    generated.unlink(missing_ok=True)
    timing = logs / f"{result.name}.timing.json"
    timing.unlink(missing_ok=True)
    argv: list[str | Path] = [env.layout.base_python(python), "-P", "-m", "pytest", *TEST_PATHS, "-m", marker, "-p",
            "no:cacheprovider", f"--junitxml={junit}", *extra]
    run_env = env.session_env(python, release)
    run_env["MCORE_COMPAT_FAULT_REPORT"] = str(faults)  # the fault-injection suite writes its score there
    run_env["MCORE_COMPAT_MEGATRON_FAULT_REPORT"] = str(megatron_faults)  # tests/test_megatron_faults.py's score
    run_env["MCORE_COMPAT_CHECKPOINT_REPORT"] = str(checkpoints)  # tests/test_checkpoint_cross.py's loads
    run_env["MCORE_COMPAT_GENERATED_REPORT"] = str(generated)  # tests/test_generated_settings.py's case counts
    run_env["MCORE_COMPAT_TIMING_REPORT"] = str(timing)  # tests/conftest.py: where the session's time went
    if release is not None:  # tests/test_selfcheck_real.py: the CLI sweep's configurations, run in the warm ranks
        selfcheck = logs / f"{release.session}.selfcheck.json"
        selfcheck.unlink(missing_ok=True)
        run_env["MCORE_COMPAT_SELFCHECK_REPORT"] = str(selfcheck)
    start = time.monotonic()
    code = out.run(argv, env=run_env, check=False, cwd=env.layout.repo)
    result.timing["pytest"] = time.monotonic() - start
    if timing.is_file():
        result.timing["inside_pytest"] = json.loads(timing.read_text(encoding="utf-8"))
    result.ran_pytest = True
    junit_counts(junit, result)
    if faults.is_file():
        score = json.loads(faults.read_text(encoding="utf-8"))
        result.faults = {k: score[k] for k in ("caught", "faults", "clean_pass", "clean")}
    if megatron_faults.is_file():
        score = json.loads(megatron_faults.read_text(encoding="utf-8"))
        result.megatron_faults = {k: score[k] for k in ("caught", "acting", "not_acting", "faults", "clean_pass",
                                                        "clean")}
    if checkpoints.is_file():
        result.checkpoints = json.loads(checkpoints.read_text(encoding="utf-8"))["loads"]
    if generated.is_file():
        result.generated = json.loads(generated.read_text(encoding="utf-8"))
    if code == PYTEST_NO_TESTS:  # a session that tested nothing proves nothing: a wrong path, marker or -k
        out.say(f"ERROR: pytest collected no test (exit status {code}); a session must run tests")
        result.details = result.details or f"pytest collected no test (exit status {code})"
    elif code != 0:
        result.details = result.details or f"pytest exited with status {code}"
    if code != 0 and not (result.failed or result.errors):
        result.errors += 1
    result.ok = code == 0


def run_selfcheck(env: MatrixEnv, release: Release, out: Out, result: JobResult) -> None:
    """``mcore-compat self-check --nproc 2 --sweep --bind`` (DP=2 and TP=2 with the distributed optimizer on and
    off, PP=2): its verdict joins the job's, its per-configuration summaries go into ``result.selfcheck``."""
    path = env.layout.logs / f"{release.session}.selfcheck.json"
    path.unlink(missing_ok=True)
    out.say("mcore-compat " + " ".join(SELFCHECK_ARGS))
    start = time.monotonic()
    code = out.run([env.layout.base_python(release.python), "-P", "-m", "mcore_compat", *SELFCHECK_ARGS, "--json",
                    path], env=env.session_env(release.python, release), check=False, cwd=env.layout.repo)
    result.timing["selfcheck"] = time.monotonic() - start
    record_selfcheck(path, code, result)


def record_selfcheck(path: Path, code: int | None, result: JobResult) -> None:
    """The self-check reports at ``path`` (``--json``'s list) into ``result.selfcheck``.

    ``code``: the CLI's exit status (non-zero fails the job); ``None``: pytest wrote them (the job fails unless
    the file is there and every configuration passed; pytest's own verdict counts separately).
    """
    reports = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []
    configs = [{**{k: r["settings"].get(k) for k in _SELFCHECK_KEYS}, "summary": r["summary"]} for r in reports]
    good = sum(bool(r["ok"]) for r in reports)
    passed = (code == 0) if code is not None else bool(reports) and good == len(reports)
    result.selfcheck = {"result": "pass" if passed else "fail", "configurations": configs,
                        "summary": f"{good}/{len(reports)} configurations pass"}
    if not passed:
        why = (f"self-check exited with status {code}" if code is not None else
               f"the CLI sweep's configurations in pytest: {good}/{len(reports)} passed" if reports else
               f"pytest wrote no self-check report ({path.name})")
        result.ok = False
        result.errors += 1
        result.details = "; ".join(filter(None, [result.details, why]))


def session_marker(release: Release) -> str:
    """The ``-m`` expression of ``release``'s session: the ``mcore`` tests, less those marked ``launcher`` unless the
    release is tagged so, and less those marked ``faults`` unless it is the latest listed patch of its minor (see
    versions.toml's header)."""
    left_out = [marker for marker, tag in ((LAUNCHER_TAG, LAUNCHER_TAG), (FAULTS_MARKER, FAULTS_TAG))
                if tag not in release.tags]
    return " and ".join(["mcore", *(f"not {m}" for m in left_out)])


def run_release(env: MatrixEnv, release: Release, out: Out, extra: Sequence[str] = ()) -> JobResult:
    """One release: base, limits, wheel, ``.cache/mc/<V>``, mcore-compat, start-up check, pytest, self-check.

    The self-check's sweep (:data:`SELFCHECK_ARGS`) runs through ``mcore-compat`` with freshly spawned ranks in the
    sessions tagged ``launcher`` (the CLI and spawn path: torch and Python, not the release, are under test); the
    other sessions run the same configurations, built by the CLI's own option handling, inside pytest's warm ranks
    (``tests/test_selfcheck_real.py``; a fresh interpreter importing torch and Megatron costs 5-14 s of CPU per
    rank) and record them the same way. A narrowed run (``extra`` pytest arguments, e.g. ``-k ...``) skips it.
    """

    def body(result: JobResult) -> None:
        python = release.python
        start = time.monotonic()
        env.ensure_base(python, out)
        env.check_limits(release, out)
        mc = env.ensure_mc(release, out)
        mcc = env.ensure_mcc(python, out)
        result.timing["prepare"] = time.monotonic() - start
        env.layout.logs.mkdir(parents=True, exist_ok=True)
        report_path = env.layout.logs / f"{release.session}.startup.json"
        report_path.unlink(missing_ok=True)
        out.say(f"start-up check of megatron-core {release.version} on Python {python}")
        start = time.monotonic()
        code = out.run([env.layout.base_python(python), "-P", _STARTUP_CHECK, str(release.version), mc, mcc,
                        report_path], env=env.session_env(python, release), check=False, cwd=env.layout.repo)
        result.timing["startup"] = time.monotonic() - start
        if code != 0:
            raise JobError(f"start-up check failed (exit status {code}); see its output above")
        result.report = json.loads(report_path.read_text(encoding="utf-8"))
        run_pytest(env, python, release, session_marker(release), out, result, extra)
        if extra:
            return
        if LAUNCHER_TAG in release.tags:
            run_selfcheck(env, release, out, result)
        else:  # the same configurations ran inside pytest's warm ranks (tests/test_selfcheck_real.py)
            record_selfcheck(env.layout.logs / f"{release.session}.selfcheck.json", None, result)

    return _timed(release.session, out, body)


def run_unit(env: MatrixEnv, out: Out, extra: Sequence[str] = ()) -> JobResult:
    """The tests that need no megatron-core (``-m "not mcore"``), against the installed mcore-compat."""

    def body(result: JobResult) -> None:
        env.ensure_base(env.tools_python, out)
        env.ensure_mcc(env.tools_python, out)
        run_pytest(env, env.tools_python, None, "not mcore", out, result, extra)

    return _timed("unit", out, body)


def run_lint(env: MatrixEnv, out: Out, extra: Sequence[str] = ()) -> JobResult:
    """``ruff check .``, ``mypy`` over :data:`MYPY_PATHS`, then the public API's breaking-change check
    (``scripts/gen_api.py --check``: griffe against the committed listing ``api/mcore_compat.json``), with the
    tools of the tools base.

    All always run; the job fails if any does (``extra`` goes to ruff).
    """

    def body(result: JobResult) -> None:
        exe = env.ensure_base(env.tools_python, out)
        failed = []
        for tool, argv in (("ruff check", ["-m", "ruff", "check", ".", *extra]),
                           ("mypy", ["-m", "mypy", *MYPY_PATHS]),
                           ("api check", ["scripts/gen_api.py", "--check"])):
            code = out.run([exe, *argv], check=False, cwd=env.layout.repo)
            if code != 0:
                failed.append(f"{tool} exited with status {code}")
        result.ok = not failed
        if failed:
            result.details, result.errors = "; ".join(failed), len(failed)

    return _timed("lint", out, body)


def run_docs(env: MatrixEnv, out: Out, extra: Sequence[str] = ()) -> JobResult:
    """The documentation site: ``mkdocs build --strict`` (a warning or a broken link fails) into ``.cache/site``,
    with the tools of ``.cache/docs-venv`` (:meth:`~ci.matrix_env.MatrixEnv.ensure_docs_venv`; ``extra`` goes to
    mkdocs)."""

    def body(result: JobResult) -> None:
        exe = env.ensure_docs_venv(out)
        code = out.run([exe, "-m", "mkdocs", "build", "--strict", "-d", env.layout.site, *extra], check=False,
                       cwd=env.layout.repo)
        result.ok = code == 0
        if code != 0:
            result.details, result.errors = f"mkdocs build --strict exited with status {code}", 1

    return _timed("docs", out, body)
