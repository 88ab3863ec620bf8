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
    }
