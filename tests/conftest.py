"""Shared pytest configuration.

Tests marked ``mcore`` need a real megatron-core on ``sys.path``; they run inside a nox matrix session (one per
release). Outside such a session (no megatron-core importable) they are skipped with the reason.

``rank_group``: ONE group of 2 gloo ranks for the whole pytest session (a :class:`mcore_compat.launch.Group`):
every module's multi-rank scenarios run in it one after another, so a release session starts processes and
imports torch and Megatron there once instead of once per module. It is registered as a plugin so that the
example suites (examples/*/tests, whose conftest calls :func:`pytest_configure` too) share the same group.
A module whose scenarios (``tests/_<name>_scenarios.py``) return ``{"version", "cases"}`` per rank runs them
with :func:`run_scenarios` in a module-scoped fixture and reads one case with :func:`case_results`
(``from conftest import case_results, run_scenarios``). :func:`run_in_one_process` makes several command
lines (``-m mcore_compat ...``, ``-c CODE``) in ONE fresh interpreter, each with its own output and exit status.

No Megatron import at collection: the same plugin records which ``megatron.core`` modules are in ``sys.modules``
when collection ends (the session fixture ``megatron_at_collection``), and tests/test_suite_rules.py fails if
there are any. Importing Megatron while collecting would run it before any test can apply the patches that must precede
the import (the apex / TransformerEngine stand-ins), turning release sessions into test-order lotteries. Note
that ``importlib.util.find_spec("megatron.core.x")`` imports ``megatron.core``: ask at run time instead.

Where a session's time goes: when ``$MCORE_COMPAT_TIMING_REPORT`` names a file (the matrix sets it), the same plugin
writes there, at the end of the session, the seconds of collection, of the setup/call/teardown phases, of every
start of ranks in this process (:func:`mcore_compat.launch.start_log`: how many ranks, spawned or forked, of
which importing torch), of the subprocesses the tests ran (``subprocess.run``, counted) and per test module; the
matrix prints one line per session from it.

Skips in a release session are release limits: an ``mcore`` test skipped while megatron-core is on ``sys.path``
must give a reason that names the installed release (``"... megatron-core 0.4.0 has no ..."``); a skip that does
not is reported as a failure. A failure is never turned into a skip.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import json
import os
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def megatron_core_on_path() -> bool:
    """Whether a ``megatron/core`` package is on ``sys.path``, found without importing anything (not even the
    ``megatron`` namespace package, which ``find_spec("megatron.core")`` would import)."""
    if "megatron.core" in sys.modules:
        return True
    spec = importlib.machinery.PathFinder.find_spec("megatron")
    if spec is None:
        return False
    return any(os.path.isfile(os.path.join(loc, "core", "__init__.py"))
               for loc in spec.submodule_search_locations or ())


def megatron_core_modules() -> list[str]:
    """The ``megatron.core`` modules imported in this process."""
    return sorted(m for m in sys.modules if m == "megatron.core" or m.startswith("megatron.core."))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if megatron_core_on_path():
        return
    skip = pytest.mark.skip(reason="needs megatron-core on sys.path (run it in a nox matrix session: nox -l)")
    for item in items:
        if "mcore" in item.keywords:
            item.add_marker(skip)


_GROUP_PLUGIN = "mcore-compat-rank-group"


#: The fork server's preload of every rank group of the suite: ranks are forked with torch, the CPU patches and
#: Megatron loaded (imported once per pytest process, not once per rank). The fresh-process path users get is
#: proven in every release session by the CLI self-check that follows pytest, and by tests/test_launch.py.
WARM_CPU = ("mcore_compat._util.warm_cpu",)


def _rank_group() -> Iterator[Any]:
    """2 gloo ranks shared by every module (started on first use, stopped at the end of the session)."""
    from mcore_compat.launch import Group

    with Group(2, device="cpu", destroy_subgroups=True, warm=WARM_CPU) as group:
        yield group


def run_scenarios(rank_group: Any, run_all: Callable[[], dict[str, Any]], timeout: float = 300) -> dict[str, Any]:
    """Run a scenarios module's ``run_all`` once on every rank of ``rank_group``.

    Args:
        rank_group: the session's :class:`mcore_compat.launch.Group` (the ``rank_group`` fixture).
        run_all: a module-level function (picklable) that returns ``{"version": str, "cases": {name: dict}}``
            on each rank; every case dict has a ``"status"`` (``"error"`` with an ``"error"`` text when it raised).
        timeout: seconds the run may take once the ranks are up.

    Returns:
        ``{"version": <the release rank 0 saw>, "ranks": [<rank 0's cases>, <rank 1's cases>, ...]}``.

    Raises:
        mcore_compat.launch.RankFailure: a rank raised outside its cases or exited abnormally.
        mcore_compat.launch.RankTimeout: the ranks did not finish within ``timeout``.
    """
    per_rank = rank_group.run(run_all, timeout=timeout)
    return {"version": per_rank[0]["version"], "ranks": [r["cases"] for r in per_rank]}


def case_results(results: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """Every rank's result of case ``name`` in ``results`` (from :func:`run_scenarios`), rank 0 first.

    Args:
        results: what :func:`run_scenarios` returned.
        name: the case.

    Returns:
        The case's dict of each rank.

    Raises:
        KeyError: no rank ran ``name``.
        pytest.fail.Exception: the case raised on a rank (the test fails with that rank's traceback).
    """
    per_rank = [r[name] for r in results["ranks"]]
    for rank, r in enumerate(per_rank):
        if r["status"] == "error":
            pytest.fail(f"{name} on rank {rank} ({results['version']}) raised:\n{r['error']}")
    return per_rank


def supported_case(results: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """:func:`case_results`, skipping the test (naming the release's limit) where the case reported itself
    ``unsupported`` on the installed release."""
    per_rank = case_results(results, name)
    if per_rank[0]["status"] == "unsupported":
        pytest.skip(f"release limit of megatron-core {results['version']}: {per_rank[0]['reason']}")
    return per_rank


#: The child of :func:`run_in_one_process`: each command line as the interpreter would run it (``-m``: the
#: module's ``__main__`` through ``runpy``; ``-c``: the code as ``__main__``), stdout, stderr and status apart.
_RUN_EACH = r"""
import contextlib, io, json, runpy, sys, traceback
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = ["-c", *argv[2:]]
                exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        except Exception:  # as an uncaught exception in a process: the traceback on stderr, status 1
            traceback.print_exc()
            code = 1
    results.append([code, out.getvalue(), err.getvalue()])
sys.stdout.write("RESULT=" + json.dumps(results) + "\n")
"""


def run_in_one_process(runs: Sequence[Sequence[str]], cwd: Path, env: Mapping[str, str] | None = None,
                       flags: Sequence[str] = (), timeout: float = 600) -> list[subprocess.CompletedProcess[str]]:
    """Run several command lines one after another in ONE fresh interpreter, as if each were its own process.

    For commands that change nothing in the process they run in (``doctor``, a self-check stopped by its
    pre-flight): one start of torch instead of one per command. Order the runs so that one that imports
    Megatron (``doctor --probe``) comes after those that must see a process that has not.

    Args:
        runs: the interpreter's arguments of each run: ``["-m", "mcore_compat", "doctor", ...]`` or
            ``["-c", CODE]``.
        cwd: the working directory.
        env: the environment (default: this process's).
        flags: interpreter options (e.g. ``["-P"]``).
        timeout: seconds for all the runs together.

    Returns:
        One ``CompletedProcess`` per run (``args``: the command line it stands for; ``returncode``: the status
        ``SystemExit`` gave, 1 for an uncaught exception, whose traceback is then in ``stderr``).

    Raises:
        AssertionError: the interpreter itself failed (its stderr is in the message).
        subprocess.TimeoutExpired: the runs took longer than ``timeout``.
    """
    for argv in runs:
        assert argv and argv[0] in ("-m", "-c") and len(argv) >= 2, argv
    proc = subprocess.run([sys.executable, *flags, "-c", _RUN_EACH, json.dumps([list(a) for a in runs])],
                          capture_output=True, text=True, cwd=cwd, env=dict(os.environ if env is None else env),
                          timeout=timeout, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT=")]
    assert proc.returncode == 0 and lines, f"the runs failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    results = json.loads(lines[-1][len("RESULT="):])
    return [subprocess.CompletedProcess([sys.executable, *flags, *argv], code, out, err)
            for argv, (code, out, err) in zip(runs, results, strict=True)]


def _installed_release() -> str | None:
    try:
        from mcore_compat.detect import detect

        return str(detect().version)
    except Exception:  # no readable release: the rule below cannot apply
        return None


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def _release_limit_only(item: pytest.Item, report: pytest.TestReport) -> pytest.TestReport:
    """Fail an ``mcore`` test's skip whose reason does not name the installed release."""
    if not report.skipped or hasattr(report, "wasxfail") or "mcore" not in item.keywords \
            or not megatron_core_on_path():
        return report
    release, reason = _installed_release(), _skip_reason(report)
    if release is None or release in reason:
        return report
    report.outcome = "failed"
    report.longrepr = (f"skipped without naming a limit of the installed release (megatron-core {release}): "
                       f"{reason!r}. In a release session a skip must be a release limit and say so (name the "
                       f"release); anything else is a failure.")
    return report


class _Timing:
    """The session's time by kind (see the module docstring); written by :meth:`write` when asked for."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.collect: list[float] = []
        self.phases = {"setup": 0.0, "call": 0.0, "teardown": 0.0}
        self.modules: dict[str, float] = {}
        self.subprocesses: list[float] = []
        self._real_run = subprocess.run

    def timed_run(self, *args: Any, **kwargs: Any) -> Any:
        """``subprocess.run``, its wall time counted."""
        start = time.monotonic()
        try:
            return self._real_run(*args, **kwargs)
        finally:
            self.subprocesses.append(time.monotonic() - start)

    def add(self, report: pytest.TestReport) -> None:
        self.phases[report.when] = self.phases.get(report.when, 0.0) + report.duration
        module = report.nodeid.split("::")[0]
        self.modules[module] = self.modules.get(module, 0.0) + report.duration

    def write(self, path: str) -> None:
        from mcore_compat.launch import start_log

        data = {
            "seconds": time.monotonic() - self.started,
            "collect": self.collect[1] - self.collect[0] if len(self.collect) == 2 else None,
            **self.phases,
            "rank_starts": [dataclasses.asdict(r) for r in start_log()],
            "subprocesses": {"count": len(self.subprocesses), "seconds": sum(self.subprocesses)},
            "modules": dict(sorted(self.modules.items(), key=lambda kv: -kv[1])),
        }
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1)


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin(_GROUP_PLUGIN):
        plugin = types.ModuleType(_GROUP_PLUGIN)
        plugin.rank_group = pytest.fixture(scope="session", name="rank_group")(_rank_group)  # type: ignore[attr-defined]
        found: list[list[str]] = []
        timing = _Timing()
        timing_report = os.environ.get("MCORE_COMPAT_TIMING_REPORT")
        if timing_report:
            subprocess.run = timing.timed_run  # type: ignore[assignment]  # the tests' lookups go through it

        def pytest_collection(session: pytest.Session) -> None:
            timing.collect[:] = [time.monotonic()]

        def pytest_collection_finish(session: pytest.Session) -> None:
            found.append(megatron_core_modules())
            timing.collect.append(time.monotonic())

        def pytest_runtest_logreport(report: pytest.TestReport) -> None:
            timing.add(report)

        def pytest_sessionfinish(session: pytest.Session) -> None:
            if timing_report:
                subprocess.run = timing._real_run  # type: ignore[assignment]
                timing.write(timing_report)

        def megatron_at_collection() -> list[str]:
            """The ``megatron.core`` modules that were imported when collection ended."""
            assert found, "pytest_collection_finish of the mcore-compat plugin did not run"
            return found[-1]

        @pytest.hookimpl(wrapper=True)
        def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
            report = yield
            return _release_limit_only(item, report)

        plugin.pytest_collection = pytest_collection  # type: ignore[attr-defined]
        plugin.pytest_collection_finish = pytest_collection_finish  # type: ignore[attr-defined]
        plugin.pytest_runtest_logreport = pytest_runtest_logreport  # type: ignore[attr-defined]
        plugin.pytest_sessionfinish = pytest_sessionfinish  # type: ignore[attr-defined]
        plugin.pytest_runtest_makereport = pytest_runtest_makereport  # type: ignore[attr-defined]
        plugin.megatron_at_collection = pytest.fixture(scope="session")(megatron_at_collection)  # type: ignore[attr-defined]
        config.pluginmanager.register(plugin, _GROUP_PLUGIN)
