"""Shared pytest configuration.

Tests marked ``mcore`` need a real megatron-core on ``sys.path``; they run inside a nox matrix session (one per
release). Outside such a session (no megatron-core importable) they are skipped with the reason.

``rank_group``: ONE group of 2 gloo ranks for the whole pytest session (a :class:`mcore_compat.launch.Group`):
every module's multi-rank scenarios run in it one after another, so a release session starts processes and
imports torch and Megatron there once instead of once per module. It is registered as a plugin so that the
example suites (examples/*/tests, whose conftest calls :func:`pytest_configure` too) share the same group.
A module whose scenarios (``tests/_<name>_scenarios.py``) return ``{"version", "cases"}`` per rank runs them
with :func:`run_scenarios` in a module-scoped fixture and reads one case with :func:`case_results`
(``from conftest import case_results, run_scenarios``).

No Megatron import at collection: the same plugin records which ``megatron.core`` modules are in ``sys.modules``
when collection ends (the session fixture ``megatron_at_collection``), and tests/test_suite_rules.py fails if
there are any. Importing Megatron while collecting would run it before any test can apply the patches that must precede
the import (the apex / TransformerEngine stand-ins), turning release sessions into test-order lotteries. Note
that ``importlib.util.find_spec("megatron.core.x")`` imports ``megatron.core``: ask at run time instead.

Skips in a release session are release limits: an ``mcore`` test skipped while megatron-core is on ``sys.path``
must give a reason that names the installed release (``"... megatron-core 0.4.0 has no ..."``); a skip that does
not is reported as a failure. A failure is never turned into a skip.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types
from collections.abc import Callable, Iterator
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


def _rank_group() -> Iterator[Any]:
    """2 gloo ranks shared by every module (started on first use, stopped at the end of the session)."""
    from mcore_compat.launch import Group

    with Group(2, device="cpu", destroy_subgroups=True) as group:
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


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin(_GROUP_PLUGIN):
        plugin = types.ModuleType(_GROUP_PLUGIN)
        plugin.rank_group = pytest.fixture(scope="session", name="rank_group")(_rank_group)  # type: ignore[attr-defined]
        found: list[list[str]] = []

        def pytest_collection_finish(session: pytest.Session) -> None:
            found.append(megatron_core_modules())

        def megatron_at_collection() -> list[str]:
            """The ``megatron.core`` modules that were imported when collection ended."""
            assert found, "pytest_collection_finish of the mcore-compat plugin did not run"
            return found[-1]

        @pytest.hookimpl(wrapper=True)
        def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
            report = yield
            return _release_limit_only(item, report)

        plugin.pytest_collection_finish = pytest_collection_finish  # type: ignore[attr-defined]
        plugin.pytest_runtest_makereport = pytest_runtest_makereport  # type: ignore[attr-defined]
        plugin.megatron_at_collection = pytest.fixture(scope="session")(megatron_at_collection)  # type: ignore[attr-defined]
        config.pluginmanager.register(plugin, _GROUP_PLUGIN)
