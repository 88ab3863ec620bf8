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
        error: set when the run itself failed (a rank raised or hung) before finishing its checks.
    """

    checks: list[Check] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

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

    def render(self) -> str:
        """Human-readable report: settings, one line per check, the summary line."""
        lines = ["settings: " + ", ".join(f"{k}={v}" for k, v in self.settings.items())]
        if self.environment:
            lines.append("environment: " + ", ".join(f"{k}={v}" for k, v in self.environment.items()))
        for c in self.checks:
            where = f" (ranks {', '.join(map(str, c.ranks))})" if c.ranks else ""
            lines.append(f"  {c.status:<4}  {c.name:<28} {c.detail}{where}")
        if self.error:
            lines.append(f"error: {self.error}")
        lines.append(self.summary_line())
        return "\n".join(lines)

    def to_json(self) -> str:
        """The report as JSON (``ok`` included; every check with its ``status``)."""
        return json.dumps({"ok": self.ok, "summary": self.summary_line(), "settings": self.settings,
                           "environment": self.environment, "error": self.error,
                           "checks": [{**asdict(c), "status": c.status} for c in self.checks]},
                          indent=2, default=str)


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
