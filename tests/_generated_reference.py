"""The reference release's observations of the DRAWN generated-settings examples: the cross-release oracle.

Every release session draws the same examples (one fixed seed per property, the committed example database read
only, Hypothesis pinned in ``ci/matrix_env.py``, strategies that do not depend on the release), so each drawn example
of the properties in :data:`COMPARED` is observed on the reference release (``REFERENCE_RELEASE`` of
``_generated_scenarios``) once and its observable result committed in :data:`DRAWN` by
``scripts/generated_reference.py`` (``--check`` observes again and compares). A session compares its own observation
of the same example with the record (:func:`against_reference`):

* ``schedule``: every parameter's (lr, weight decay) at every step, or the refusal (mcore_compat's own validation:
  the same on every release), within ``_generated_scenarios.REL``;
* ``resume``: the resumed job's (lr, weight decay) per parameter from the resumed step on, or the error's type;
* ``overrides`` (0.16+; an older release refuses ``config_overrides``: not comparable): the schedule's values and
  the groups' (max_lr, min_lr, wd_mult) as built;
* ``invalid``: the type of the refusal;
* ``update``: the main params before and after the steps (within ``UPDATE_TOL`` per lr and ``ULPS``), which fp16
  steps were skipped and every loss scale (exactly); a release that refuses the settings (``UnsupportedVersionError``,
  e.g. coupled weight decay before 0.15) is not comparable.

Not compared here: ``builders`` (its observation is the release's own config class, whose fields differ per release by
design: it is compared with that class instead) and ``schedules`` (its oracle, the float64 gradient from the math
of ``mcore_compat.selfcheck.plain_gpt``, is one oracle for every release already).

Counts per property (``compared``, ``not comparable``, ``missing``) go into the property's result, and
tests/test_generated_settings.py fails a passing property with an example the record lacks (the draws or the record
changed: run the script again), so every release is compared on every comparable example. A missing example is
not a mismatch inside the property: Hypothesis would shrink a real difference to a new example the record lacks
and report that instead.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: ``{"release", "properties": {property: {example key: observable}}}``
DRAWN = HERE / "data" / "generated" / "drawn.json"
#: Set by scripts/generated_reference.py: record every observation instead of comparing.
RECORD_ENV = "MCORE_COMPAT_GENERATED_RECORD"
#: The properties whose drawn examples are compared with the reference release.
COMPARED = ("schedule", "resume", "overrides", "invalid", "update")

_record: dict[str, Any] | None = None
_recorded: dict[str, dict[str, Any]] = {}
_counts: dict[str, dict[str, int]] = {}


def example_key(example: dict[str, Any]) -> str:
    """A stable name of ``example`` (its canonical JSON's digest)."""
    text = json.dumps(example, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def recording() -> bool:
    return bool(os.environ.get(RECORD_ENV))


def _reference() -> dict[str, Any]:
    global _record
    if _record is None:
        try:
            _record = json.loads(DRAWN.read_text(encoding="utf-8"))
        except FileNotFoundError:
            _record = {"release": None, "properties": {}}
    return _record


def counts(prop: str) -> dict[str, int]:
    """This rank's counts of ``prop`` so far: ``compared``, ``not comparable``, ``missing``."""
    return dict(_counts.get(prop, {"compared": 0, "not comparable": 0, "missing": 0}))


def recorded() -> dict[str, Any]:
    """What this rank recorded (record mode): ``{property: {key: observable}}``."""
    return {p: dict(v) for p, v in _recorded.items()}


def against_reference(prop: str, example: dict[str, Any], observable: dict[str, Any] | None,
                      differences: Callable[[dict[str, Any], dict[str, Any]], list[str]]) -> list[str]:
    """Record ``observable`` (record mode) or compare it with the reference release's observation of the same
    example (``differences(mine, theirs)``: the differences in words). ``observable`` None: not comparable on this
    release (it refuses the settings for a reason of its own)."""
    key = example_key(example)
    if recording():
        if observable is not None:
            _recorded.setdefault(prop, {})[key] = observable
        return []
    count = _counts.setdefault(prop, {"compared": 0, "not comparable": 0, "missing": 0})
    if observable is None:
        count["not comparable"] += 1
        return []
    ref = _reference()
    theirs = ref.get("properties", {}).get(prop, {}).get(key)
    if theirs is None:  # counted, not a mismatch: else Hypothesis would shrink a real difference to a new example
        count["missing"] += 1
        return []
    count["compared"] += 1
    return [f"against the reference release {ref.get('release')}: {d}" for d in differences(observable, theirs)]


# ------------------------------------------------------------------------------------- observables, differences
def close_tables(mine: list[dict[str, list[float]]], theirs: list[dict[str, list[float]]],
                 close: Callable[[float, float], bool], what: str) -> list[str]:
    """Per step, every parameter's (lr, wd) against the reference's."""
    if len(mine) != len(theirs):
        return [f"{what}: {len(mine)} steps observed, the reference observed {len(theirs)}"]
    for step, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        if set(a) != set(b) or any(len(a[n]) != len(b[n]) or not all(close(x, y) for x, y in zip(a[n], b[n],
                                                                                                strict=True))
                                   for n in a):
            return [f"{what} at step {step}: (lr, wd) per parameter {a}, the reference release's {b}"]
    return []


def update_differences(mine: dict[str, Any], theirs: dict[str, Any], lrs: dict[str, float], steps: int,
                       tol: float, ulps: int) -> list[str]:
    """Main params before (within ``ulps`` fp32 ulp) and the change over the steps (within ``tol`` times the
    parameter's lr per step, plus ``ulps``) against the reference's."""
    bad = []
    for name, start in mine["start"].items():
        if name not in theirs["start"]:
            return [f"{name}: not in the reference release's observation"]
        allowed = tol * lrs[name] * steps
        for i, (s0, s1, r0, r1) in enumerate(zip(start, mine["end"][name], theirs["start"][name],
                                                 theirs["end"][name], strict=True)):
            unit = ulps * 2.0 ** -23 * max(abs(s1), abs(r1))
            if not abs(s0 - r0) <= unit or not abs((s1 - s0) - (r1 - r0)) <= allowed + unit:
                bad.append(f"{name}[{i}]: from {s0!r} to {s1!r}, on the reference release from {r0!r} to {r1!r} "
                           f"(tolerance {allowed:.2e})")
                break
    return bad
