"""Faults inside Megatron-Core (tests/_megatron_faults.py: a Megatron function replaced in the ranks, never one of
mcore_compat's), on the session's 2 gloo ranks: every fault that ACTS on the installed release is caught (at
least one of its listed checks FAILS); a fault whose target does not exist on the release or did not run in its
configuration is skipped as "not acting", never counted as caught. Each configuration also runs clean in the
same harness and must pass. The score goes to ``$MCORE_COMPAT_MEGATRON_FAULT_REPORT`` (when set) for the matrix.
"""

from __future__ import annotations

import json
import os
from typing import Any

import _megatron_faults as mf
import pytest

from mcore_compat.launch import Group
from mcore_compat.selfcheck import Report
from mcore_compat.selfcheck.report import merge_rank_checks

pytestmark = [pytest.mark.mcore, pytest.mark.faults]


def _report(per_rank: list[dict[str, Any]], settings: dict[str, Any]) -> Report:
    report = Report(settings=settings)
    errors = [r["error"] for r in per_rank if r.get("error")]
    if errors:
        report.error = errors[0].strip().splitlines()[-1]
        report.tracebacks = dict(enumerate(errors))
    else:
        report.checks = merge_rank_checks([r["checks"] for r in per_rank])
    return report


def _verdict(name: str, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One fault's outcome over the ranks: ``status`` is ``caught``, ``missed``, ``not acting`` or ``error``."""
    fault = mf.FAULTS[name]
    first = per_rank[0]
    if "absent" in first:
        return {"status": "not acting", "why": first["absent"]}
    report = _report(per_rank, {"fault": name, "config": fault.config})
    acted = sum(r["acted"] for r in per_rank)
    calls = sum(r["calls"] for r in per_rank)
    failed = sorted(c.name for c in report.failed)
    out = {"acted": acted, "calls": calls, "failed": failed, "notes": [n for r in per_rank for n in r["notes"]],
           "seconds": max(r.get("seconds", 0.0) for r in per_rank), "report": report}
    if report.error is not None:
        return {**out, "status": "error", "why": report.error}
    if not acted:
        why = "its target never ran" if not calls else f"its target ran {calls} time(s) and changed nothing"
        return {**out, "status": "not acting", "why": f"{why} in configuration {fault.config}"}
    return {**out, "status": "caught" if set(failed) & fault.must_fail else "missed"}


@pytest.fixture(scope="module")
def outcome(rank_group: Group) -> dict[str, Any]:
    per_rank = rank_group.run(mf.run_all, timeout=900)
    version = per_rank[0]["version"]
    clean = {c: _report([r["clean"][c] for r in per_rank], mf.CONFIGS[c]) for c in per_rank[0]["clean"]}
    faults = {n: _verdict(n, [r["faults"][n] for r in per_rank]) for n in mf.FAULTS}
    seconds = sum(max(r["clean"][c]["seconds"] for r in per_rank) for c in clean) + \
        sum(f.get("seconds", 0.0) for f in faults.values())
    result = {"version": version, "clean": clean, "faults": faults, "unsupported": per_rank[0]["unsupported"],
              "seconds": round(seconds, 1)}
    _write_score(result)
    return result


def _write_score(result: dict[str, Any]) -> None:
    """The Megatron-fault score of this release (for the matrix), when the session asks for it."""
    target = os.environ.get("MCORE_COMPAT_MEGATRON_FAULT_REPORT")
    if not target:
        return
    details = {n: {k: v for k, v in f.items() if k != "report"} for n, f in result["faults"].items()}
    acting = [n for n, f in details.items() if f["status"] != "not acting"]
    with open(target, "w", encoding="utf-8") as fh:
        json.dump({"caught": sum(details[n]["status"] == "caught" for n in acting), "acting": len(acting),
                   "not_acting": len(details) - len(acting), "faults": len(details),
                   "clean_pass": sum(r.ok for r in result["clean"].values()), "clean": len(result["clean"]),
                   "seconds": result["seconds"], "details": details}, fh, indent=2)


def test_every_fault_names_its_targets_and_checks() -> None:
    """Every fault says what it simulates, its targets, configuration and checks, and why it cannot exist where
    its targets' ranges leave a release out (0.4.0 is the oldest)."""
    from packaging.version import Version

    from mcore_compat._facts.ranges import in_range

    for name, fault in mf.FAULTS.items():
        assert fault.simulates and fault.targets and fault.must_fail and fault.config in mf.CONFIGS, name
        assert fault.absent or any(in_range(Version("0.4.0"), t.releases) for t in fault.targets), name


@pytest.mark.parametrize("config", list(mf.CONFIGS))
def test_configuration_passes_clean_in_the_harness(outcome: dict[str, Any], config: str) -> None:
    """No fault: the same harness and configuration PASS (a harness that always fails cannot pass the tests)."""
    if config in outcome["unsupported"]:
        pytest.skip(f"megatron-core {outcome['version']} cannot run {config}: {outcome['unsupported'][config]}")
    report = outcome["clean"][config]
    assert report.error is None and report.ok, report.render()
    passed = {c.name for c in report.checks if c.passed}
    for name, fault in mf.FAULTS.items():  # what catches a fault here is applied (and passes) without it
        if fault.config == config:
            assert fault.must_fail & passed, (name, sorted(passed))


@pytest.mark.parametrize("name", list(mf.FAULTS))
def test_megatron_fault_is_caught(outcome: dict[str, Any], name: str) -> None:
    verdict = outcome["faults"][name]
    fault = mf.FAULTS[name]
    if verdict["status"] == "not acting":
        pytest.skip(f"not acting on megatron-core {outcome['version']}: {verdict['why']}")
    report = verdict["report"]
    assert verdict["status"] != "error", report.render()
    assert verdict["status"] == "caught", (
        f"{name} acted {verdict['acted']} time(s) ({verdict['notes'][:2]}) but none of {sorted(fault.must_fail)} "
        f"failed; failed: {verdict['failed']}\n{report.render()}")
    directional = [c for c in report.failed if c.name == "grads_match_directional_derivatives"]
    if directional:  # bisected down to single parameters, each named with the numbers that fail it
        named = directional[0].numbers.get("params", [])
        assert any(" (the " in n and "params from" not in n for n in named), (name, named)
