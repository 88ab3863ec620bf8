"""Self-check results: one :class:`Check` per property, merged over ranks into a :class:`Report`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Check", "Report", "merge_rank_checks"]


@dataclass(frozen=True)
class Check:
    """One property checked, with the numbers behind the verdict.

    Attributes:
        name: stable identifier (e.g. ``"params_changed"``).
        passed: the verdict.
        detail: one human-readable line with the numbers.
        numbers: the raw numbers (JSON-serialisable).
        ranks: the ranks it failed on (filled when merging).
    """

    name: str
    passed: bool
    detail: str
    numbers: dict[str, Any] = field(default_factory=dict)
    ranks: tuple[int, ...] = ()


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
        """True only if the run finished and every check passed."""
        return self.error is None and bool(self.checks) and all(c.passed for c in self.checks)

    def failed(self) -> list[Check]:
        """The checks that failed."""
        return [c for c in self.checks if not c.passed]

    def summary_line(self) -> str:
        """``self-check: PASS (9/9 checks)`` or ``self-check: FAIL (2 of 9 failed: a, b)``."""
        if self.error is not None:
            return f"self-check: FAIL (run error: {self.error.splitlines()[0] if self.error else ''})"
        bad = self.failed()
        if not bad and self.checks:
            return f"self-check: PASS ({len(self.checks)}/{len(self.checks)} checks)"
        return f"self-check: FAIL ({len(bad)} of {len(self.checks)} failed: {', '.join(c.name for c in bad)})"

    def render(self) -> str:
        """Human-readable report: settings, one line per check, the summary line."""
        lines = ["settings: " + ", ".join(f"{k}={v}" for k, v in self.settings.items())]
        if self.environment:
            lines.append("environment: " + ", ".join(f"{k}={v}" for k, v in self.environment.items()))
        for c in self.checks:
            where = f" (ranks {', '.join(map(str, c.ranks))})" if c.ranks else ""
            lines.append(f"  {'PASS' if c.passed else 'FAIL'}  {c.name:<28} {c.detail}{where}")
        if self.error:
            lines.append(f"error: {self.error}")
        lines.append(self.summary_line())
        return "\n".join(lines)

    def to_json(self) -> str:
        """The report as JSON (``ok`` included)."""
        return json.dumps({"ok": self.ok, "summary": self.summary_line(), "settings": self.settings,
                           "environment": self.environment, "error": self.error,
                           "checks": [asdict(c) for c in self.checks]}, indent=2, default=str)


def merge_rank_checks(per_rank: list[list[Check]]) -> list[Check]:
    """Merge each rank's checks: a check passes only if it passed on every rank that ran it.

    The merged detail is rank 0's, or the first failing rank's when it failed somewhere.
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
        bad = [(r, c) for r, c in entries if not c.passed]
        shown = bad[0][1] if bad else entries[0][1]
        merged.append(Check(name, not bad, shown.detail, shown.numbers, tuple(r for r, _ in bad)))
    return merged
