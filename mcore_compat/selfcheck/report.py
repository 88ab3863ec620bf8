"""Self-check results: one :class:`Check` per property, merged over ranks into a :class:`Report`.

A check is PASS, FAIL or N/A: a property that cannot be tested in a configuration (data-parallel ranks
identical when there is one data-parallel rank, model params equal to the main params when they are the same
tensors) is reported "not applicable" with the reason, never as a PASS.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Check", "Report", "merge_rank_checks"]


@dataclass(frozen=True)
class Check:
    """One property checked, with the numbers behind the verdict.

    Attributes:
        name: stable identifier (e.g. ``"grads_match_reference"``).
        passed: the verdict (``False`` for a check that does not apply).
        detail: one human-readable line with the numbers, or why the check does not apply.
        numbers: the raw numbers (JSON-serialisable).
        ranks: the ranks it failed on (filled when merging).
        applicable: ``False``: the property cannot be tested here (:attr:`detail` says why).
    """

    name: str
    passed: bool
    detail: str
    numbers: dict[str, Any] = field(default_factory=dict)
    ranks: tuple[int, ...] = ()
    applicable: bool = True

    @classmethod
    def not_applicable(cls, name: str, why: str) -> Check:
        """A check that cannot be tested in this configuration."""
        return cls(name, False, why, applicable=False)

    @property
    def status(self) -> str:
        """``"PASS"``, ``"FAIL"`` or ``"N/A"``."""
        if not self.applicable:
            return "N/A"
        return "PASS" if self.passed else "FAIL"

    @property
    def failed(self) -> bool:
        """An applicable check that did not pass."""
        return self.applicable and not self.passed


@dataclass
class Report:
    """Everything a self-check found.

    Attributes:
        checks: merged checks, in the order they ran.
        settings: the configuration checked (world size, tp/pp/dp, dtype, ...).
        environment: versions of python/torch/megatron-core, device.
        error: set when the run itself failed (a rank raised or hung) before finishing its checks: one line.
        tracebacks: rank -> the traceback of a rank that raised (shown by :meth:`render` with ``debug=True``).
        stacks: rank -> the Python stacks of a rank stopped at the timeout (always shown, one rank after another).
        warnings: the distinct warnings the ranks recorded (Megatron's, torch's; see
            :func:`~mcore_compat.selfcheck.noise.merge`): counted by :meth:`render`, listed with ``verbose=True``.
    """

    checks: list[Check] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    tracebacks: dict[int, str] = field(default_factory=dict)
    stacks: dict[int, str] = field(default_factory=dict)
    warnings: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True only if the run finished, at least one check applied, and no check failed."""
        return self.error is None and any(c.applicable for c in self.checks) and not self.failed

    @property
    def failed(self) -> list[Check]:
        """The checks that failed."""
        return [c for c in self.checks if c.failed]

    @property
    def not_applicable(self) -> list[Check]:
        """The checks that could not be tested in this configuration."""
        return [c for c in self.checks if not c.applicable]

    def check(self, name: str) -> Check | None:
        """The check called ``name`` (``None`` if it did not run)."""
        return next((c for c in self.checks if c.name == name), None)

    def summary_line(self) -> str:
        """``self-check: PASS (9 passed, 2 not applicable)`` or ``self-check: FAIL (2 of 9 failed: a, b)``."""
        if self.error is not None:
            return f"self-check: FAIL (run error: {self.error.splitlines()[0] if self.error else ''})"
        bad = self.failed
        applicable = [c for c in self.checks if c.applicable]
        na = len(self.checks) - len(applicable)
        tail = f", {na} not applicable" if na else ""
        if not bad and applicable:
            return f"self-check: PASS ({len(applicable)} passed{tail})"
        if not applicable:
            return f"self-check: FAIL (no check applied{tail})"
        return (f"self-check: FAIL ({len(bad)} of {len(applicable)} failed: {', '.join(c.name for c in bad)}"
                f"{tail})")

    def render(self, verbose: bool = False, debug: bool = False) -> str:
        """Human-readable report: the ranks' warnings (counted, or listed with ``verbose``), settings, one line per
        check, a run error with the hung ranks' stacks (and, with ``debug``, the failed ranks' tracebacks), the
        summary line."""
        lines = _warning_lines(self.warnings, verbose)
        lines.append("settings: " + ", ".join(f"{k}={v}" for k, v in self.settings.items()))
        if self.environment:
            lines.append("environment: " + ", ".join(f"{k}={v}" for k, v in self.environment.items()))
        for c in self.checks:
            where = f" (ranks {', '.join(map(str, c.ranks))})" if c.ranks else ""
            lines.append(f"  {c.status:<4}  {c.name:<28} {c.detail}{where}")
        for rank, stack in sorted(self.stacks.items()):
            lines += [f"--- rank {rank}: Python stacks when it was stopped ---", stack.rstrip()]
        if debug:
            for rank, tb in sorted(self.tracebacks.items()):
                lines += [f"--- rank {rank}: traceback ---", tb.rstrip()]
        lines.append(self.summary_line())
        if self.tracebacks and not debug:
            lines.append("(the ranks' tracebacks: --debug, or report.render(debug=True))")
        return "\n".join(lines)

    def to_json(self) -> str:
        """The report as JSON (``ok`` included; every check with its ``status``; the mcore-compat version and the UTC
        time it was written; Megatron-Core's version is in ``environment``)."""
        import datetime

        from .._version import __version__

        return json.dumps({"ok": self.ok, "summary": self.summary_line(), "mcore_compat": __version__,
                           "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           "settings": self.settings,
                           "environment": self.environment, "error": self.error,
                           "checks": [{**asdict(c), "status": c.status} for c in self.checks],
                           "tracebacks": {str(r): t for r, t in sorted(self.tracebacks.items())},
                           "stacks": {str(r): t for r, t in sorted(self.stacks.items())},
                           "warnings": self.warnings},
                          indent=2, default=str)


def _warning_lines(recorded: list[dict[str, Any]], verbose: bool) -> list[str]:
    """One line counting the ranks' distinct warnings, or (``verbose``) each of them once."""
    if not recorded:
        return []
    total = sum(int(w.get("count", 1)) for w in recorded)
    if not verbose:
        return [f"warnings: {len(recorded)} distinct on the ranks ({total} in all, printed by Megatron, torch or "
                f"mcore-compat while importing and training); -v lists each once"]
    lines = [f"warnings from the ranks ({len(recorded)} distinct, {total} in all), each once:"]
    for w in recorded:
        ranks = ", ".join(map(str, w.get("ranks", [])))
        lines.append(f"  {w['category']} at {w['where']} (ranks {ranks}): {w['message']}")
    return lines


def merge_rank_checks(per_rank: list[list[Check]]) -> list[Check]:
    """Merge each rank's checks: FAIL if it failed on any rank, else PASS if it passed on any rank, else N/A.

    The merged detail is the first failing rank's, else the first passing rank's, else rank 0's.
    """
    order: list[str] = []
    by_name: dict[str, list[tuple[int, Check]]] = {}
    for rank, checks in enumerate(per_rank):
        for c in checks:
            if c.name not in by_name:
                order.append(c.name)
                by_name[c.name] = []
            by_name[c.name].append((rank, c))
    merged = []
    for name in order:
        entries = by_name[name]
        bad = [(r, c) for r, c in entries if c.failed]
        good = [(r, c) for r, c in entries if c.applicable and c.passed]
        shown = (bad or good or entries)[0][1]
        merged.append(Check(name, not bad and bool(good), shown.detail, shown.numbers, tuple(r for r, _ in bad),
                            applicable=bool(bad or good)))
    return merged
