"""One meaning over the settings space: Hypothesis draws optimizer and scheduler settings, built through
mcore_compat on the session's release (2 gloo ranks, DP=2), and compares them with the spec (``_spec_oracle``) and
raw Megatron (where the raw call accepts them). Every release session draws the same examples (a fixed seed) and replays the committed example database (``tests/data/hypothesis/``).

The scenarios run inside the ranks (``_generated_scenarios``); here each property's verdict is read, with
Hypothesis's falsifying example when it failed. The case counts go to ``$MCORE_COMPAT_GENERATED_REPORT``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import _generated_reference as R
import _generated_scenarios as S
import pytest
from packaging.version import Version

pytestmark = pytest.mark.mcore

REPORT_ENV = "MCORE_COMPAT_GENERATED_REPORT"


@pytest.fixture(scope="module")
def results(rank_group: Any) -> dict[str, Any]:
    per_rank = rank_group.run(S.run_all, timeout=900)
    out = {"version": per_rank[0]["version"], "cases": per_rank[0]["cases"]}
    report = os.environ.get(REPORT_ENV)
    if report:
        Path(report).write_text(json.dumps(_score(out), indent=1) + "\n", encoding="utf-8")
    return out


def _score(results: dict[str, Any]) -> dict[str, Any]:
    props = results["cases"]
    return {"examples": {k: v["examples"] for k, v in props.items()},
            "reference": {k: v["reference"] for k, v in props.items() if "reference" in v},
            "reference_release": S.REFERENCE_RELEASE,
            "failed": sorted(k for k, v in props.items() if v["status"] != "pass")}


@pytest.mark.parametrize("prop", S.PROPERTIES)
def test_property_holds(results: dict[str, Any], prop: str) -> None:
    case = results["cases"][prop]
    assert case["status"] == "pass", f"megatron-core {results['version']}: {prop}:\n{case['failure']}"
    assert case["examples"] > 0


@pytest.mark.parametrize("prop", R.COMPARED)
def test_drawn_examples_are_compared_with_the_reference_release(results: dict[str, Any], prop: str) -> None:
    """Every drawn example was observed on the reference release too (the same draws on every release) and is
    compared with its record, except where this release refuses the settings for a reason of its own (coupled
    weight decay before 0.15, ``config_overrides`` before 0.16): those are counted as not comparable, never on the
    reference release itself."""
    case = results["cases"][prop]
    if case["status"] != "pass":
        pytest.skip(f"megatron-core {results['version']}: {prop} failed (its shrinking draws examples the record "
                    f"lacks): see test_property_holds[{prop}]")
    counts = case["reference"]
    assert counts["missing"] == 0, (f"{counts['missing']} drawn example(s) not in the reference release's record "
                                    f"{R.DRAWN.name}: the draws or the record changed; run python "
                                    f"scripts/generated_reference.py")
    assert counts["compared"] + counts["not comparable"] == counts["drawn"] > 0, counts
    if results["version"] == S.REFERENCE_RELEASE:
        assert counts["not comparable"] == 0, counts
    elif prop != "overrides" or Version(results["version"]) >= Version("0.16"):
        assert counts["compared"] > 0, counts
