"""``independent_reference_matches`` on the installed release, on the session's 2 gloo ranks (``rank_group``):
the self-check's tiny GPT (and its MLP) against the float64 model written from the math
(:mod:`mcore_compat.selfcheck.plain_gpt`).

* clean runs PASS it (and the rest of the self-check);
* faults placed inside Megatron's own layer code FAIL it: a missing tensor-parallel output reduction, a stale
  weight in ColumnParallelLinear's forward, weight-gradient rows rolled by one in Megatron's linear autograd
  function. ``grads_match_reference`` runs a copy of the same layers, so the same fault acts on its reference
  too: it passes, which is why this check exists.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from mcore_compat.launch import Group
from mcore_compat.selfcheck import SelfCheckOptions
from mcore_compat.selfcheck.report import merge_rank_checks

pytestmark = [pytest.mark.mcore, pytest.mark.faults]  # a fault-injection suite (versions.toml)

NAME = "independent_reference_matches"

# one step where the fault acts in the first one (binding off: not what these faults touch); the clean bf16 GPT is
# in test_selfcheck_real.py's sweep, which every clean configuration of must pass
_TP2 = SelfCheckOptions(tp=2, sequence_parallel=False, model="gpt", steps=1, dtype="fp32", lr=1e-2, bind=False)
_TP1_BF16 = SelfCheckOptions(tp=1, model="gpt", steps=1, dtype="bf16", lr=1e-2, bind=False)

#: name -> (fault, options): each fault next to the same configuration run clean
CASES: dict[str, tuple[str | None, SelfCheckOptions]] = {
    "clean-tp2": (None, _TP2),
    "clean-mlp-tp2-bf16": (None, replace(_TP2, model="mlp", dtype="bf16")),
    "no_tp_reduction": ("no_tp_reduction", _TP2),
    # the forward's snapshot is stale from the second step on, after an update at lr 1e-2
    "stale_column_weight": ("stale_column_weight", replace(_TP1_BF16, steps=2)),
    "rolled_weight_grad_rows": ("rolled_weight_grad_rows", _TP1_BF16),
}


@pytest.fixture(scope="module")
def results(rank_group: Group) -> dict[str, list]:
    import _independent_scenarios as scenarios

    cases = {n: (f, replace(o, nproc=2, device="cpu").resolved()) for n, (f, o) in CASES.items()}
    per_rank = rank_group.run(scenarios.run_cases, args=(cases,), timeout=900)
    out = {}
    for name in CASES:
        errors = [r[name]["error"] for r in per_rank if r[name]["error"]]
        if errors:
            pytest.fail(f"{name} raised:\n{errors[0]}")
        out[name] = merge_rank_checks([r[name]["checks"] for r in per_rank])
    return out


def _render(checks: list) -> str:
    return "\n".join(f"{c.status} {c.name}: {c.detail}" for c in checks)


def _check(checks: list, name: str):
    return next(c for c in checks if c.name == name)


@pytest.mark.parametrize("case", [c for c, (f, _) in CASES.items() if f is None])
def test_clean_runs_pass(results: dict[str, list], case: str) -> None:
    checks = results[case]
    assert not [c for c in checks if c.failed], _render(checks)
    check = _check(checks, NAME)
    assert check.applicable and check.passed, _render(checks)
    assert "tolerance" in check.detail and "worst relative error" in check.detail, check.detail


@pytest.mark.parametrize("case", [c for c, (f, _) in CASES.items() if f is not None])
def test_fault_inside_megatron_layers_fails_the_independent_reference(results: dict[str, list], case: str) -> None:
    checks = results[case]
    check = _check(checks, NAME)
    assert check.applicable and check.failed, _render(checks)
    # the copy of the same layers computes the same wrong thing: only the independent reference sees it
    assert _check(checks, "grads_match_reference").passed, _render(checks)
