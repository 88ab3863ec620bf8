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

import _generated_scenarios as S
import pytest

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
            "failed": sorted(k for k, v in props.items() if v["status"] != "pass")}


@pytest.mark.parametrize("prop", S.PROPERTIES)
def test_property_holds(results: dict[str, Any], prop: str) -> None:
    case = results["cases"][prop]
    assert case["status"] == "pass", f"megatron-core {results['version']}: {prop}:\n{case['failure']}"
    assert case["examples"] > 0
