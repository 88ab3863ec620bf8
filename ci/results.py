"""A job's result: JUnit counts, the text of one line, the matrix's summary line, the recorded CPU result."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

#: At most this many failed test ids are named in a result's details.
_SHOWN_FAILURES = 20


@dataclass
class JobResult:
    """The outcome of one job (a nox session run alone or inside the matrix).

    Attributes:
        name: the session name (``unit``, ``lint``, ``mcore-0.16.1``).
        ok: the job passed.
        passed, failed, skipped, errors: test counts (a failed step that is not a test counts as an error).
        seconds: wall time.
        details: why it failed (or the failed test ids).
        report: the start-up check's report (a release job).
        log: the job's log file (``None``: the console).
        ran_pytest: pytest ran (a later failure does not add an error).
        selfcheck: the self-check's summary (a release job).
        faults: the fault-injection score the suite wrote (``caught``/``faults``/``clean_pass``/``clean``).
        megatron_faults: the score of the faults injected inside Megatron-Core (tests/test_megatron_faults.py:
            ``caught``/``acting``/``not_acting``/``faults``/``clean_pass``/``clean``; a fault whose target does
            not exist or run on the release is not acting, never caught).
        checkpoints: the committed checkpoints of other releases loaded on this one (tests/test_checkpoint_cross.py):
            ``{"<saving release>": {"full": "exact" | "refused: ..." | ..., "weights": ...}}``.
        generated: the generated-settings properties (tests/test_generated_settings.py): ``{"examples": {property:
            count}, "failed": [property], "reference": {property: {"compared", "not comparable", "missing",
            "drawn"}}, "reference_release"}``.
        timing: seconds per phase (``prepare``, ``startup``, ``pytest``, ``selfcheck``) and what the suite
            measured inside pytest (``inside_pytest``: see tests/conftest.py); :func:`timing_line` renders it.
    """

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
    megatron_faults: dict[str, Any] = field(default_factory=dict)
    checkpoints: dict[str, Any] = field(default_factory=dict)
    generated: dict[str, Any] = field(default_factory=dict)
    timing: dict[str, Any] = field(default_factory=dict)


def junit_counts(path: Path, result: JobResult) -> None:
    """Add a pytest ``--junitxml`` file's counts (and failed test ids, in ``details``) to ``result``.

    A missing file adds nothing.
    """
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
        more = len(bad) - _SHOWN_FAILURES
        result.details = "failed: " + ", ".join(bad[:_SHOWN_FAILURES]) + (f" (+{more} more)" if more > 0 else "")


def _counts(failed: int, passed: int, skipped: int, errors: int) -> list[str]:
    parts = [f"{n} {w}" for n, w in ((failed, "failed"), (passed, "passed"), (skipped, "skipped")) if n]
    if errors:
        parts.append(f"{errors} error" + ("s" if errors != 1 else ""))
    return parts


def counts_text(result: JobResult) -> str:
    """``"1 failed, 3 passed, 1 error"``; ``"ok"``/``"failed"`` when there is nothing to count."""
    parts = _counts(result.failed, result.passed, result.skipped, result.errors)
    return ", ".join(parts) or ("ok" if result.ok else "failed")


def summary_line(results: Sequence[JobResult], seconds: float) -> str:
    """pytest's closing line over every job: ``==== 1 failed, 13 passed, 1 error in 12.35s ====``."""
    parts = _counts(*(sum(getattr(r, k) for r in results) for k in ("failed", "passed", "skipped", "errors")))
    return f"==== {', '.join(parts) or 'no tests ran'} in {seconds:.2f}s ===="


def tail(path: Path | None, lines: int = 40) -> str:
    """The last ``lines`` lines of a log (``""`` if there is none)."""
    if path is None or not path.is_file():
        return ""
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


def cpu_record(install: str, result: JobResult) -> dict[str, Any]:
    """What ``matrix/results.json`` records of a release's CPU run.

    Args:
        install: the release's install kind (``"wheel"``/``"unpack-wheel"``).
        result: the release job's result.
    """
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
        "install": install,
        "details": result.details,
        "self_check": result.selfcheck or None,
        "fault_detection": result.faults or None,
        "megatron_fault_detection": result.megatron_faults or None,
        "checkpoint_cross": result.checkpoints or None,
        "generated_settings": result.generated or None,
        "timing": timing_record(result) or None,
    }


#: The header of :func:`timing_line`'s table (one line per session, printed at the end of every matrix run).
TIMING_HEADER = (f"{'session':<14} {'total':>6} {'prep':>5} {'start':>5} {'pytest':>6} {'coll':>5} "
                 f"{'rank starts: n, s (import s)':<30} {'subproc: n, s':<14} {'self-check':>10}  slowest test module")


def timing_record(result: JobResult) -> dict[str, Any]:
    """The compact form of ``result.timing`` recorded in ``matrix/results.json`` (seconds, rounded)."""
    t = result.timing
    inside = t.get("inside_pytest") or {}
    starts = inside.get("rank_starts") or []
    rec: dict[str, Any] = {k: round(t[k], 1) for k in ("prepare", "startup", "pytest", "selfcheck") if k in t}
    if inside:
        rec["collect"] = round(inside.get("collect") or 0.0, 1)
        rec["rank_starts"] = [{"nprocs": s["nprocs"], "method": s["method"], "seconds": round(s["seconds"], 1),
                               "import_seconds": round(s["import_seconds"], 1)} for s in starts]
        rec["subprocesses"] = {"count": inside["subprocesses"]["count"],
                               "seconds": round(inside["subprocesses"]["seconds"], 1)}
        rec["slowest_modules"] = {m: round(v, 1) for m, v in list(inside.get("modules", {}).items())[:3]}
    return rec


def timing_line(result: JobResult) -> str:
    """One line of the matrix's time table: total, prepare, start-up check, pytest (its collection, rank starts,
    subprocesses), the CLI self-check and the slowest test module (seconds)."""
    rec = timing_record(result)

    def num(key: str, width: int) -> str:
        return f"{rec[key]:>{width}.1f}" if key in rec else f"{'-':>{width}}"

    starts = rec.get("rank_starts", [])
    start_text = (f"{len(starts)}: " + "+".join(f"{s['nprocs']}{'f' if s['method'] == 'forkserver' else 's'}"
                                               f" {s['seconds']:.1f}({s['import_seconds']:.1f})" for s in starts)
                  if starts else "-")
    sub = rec.get("subprocesses")
    sub_text = f"{sub['count']}: {sub['seconds']:.1f}" if sub else "-"
    slow = next(iter(rec.get("slowest_modules", {}).items()), None)
    slow_text = f"{slow[0].rsplit('/', 1)[-1]} {slow[1]:.1f}" if slow else ""
    return (f"{result.name:<14} {result.seconds:>6.1f} {num('prepare', 5)} {num('startup', 5)} {num('pytest', 6)} "
            f"{num('collect', 5)} {start_text:<30} {sub_text:<14} {num('selfcheck', 10)}  {slow_text}")
