"""The PPO actor against the installed megatron-core: DP=2 and TP=2, distributed optimizer off and on.

ONE module-scoped ``run_all`` on the session's 2 gloo ranks (``rank_group``) runs every configuration (``_scenarios.py``); the tests
below only assert on what it returned.
"""

from __future__ import annotations

from typing import Any

import pytest
from packaging.version import Version

from ppo_actor.tests import _scenarios as SC

CASES = list(SC.CASE_NAMES)
DP_CASES = [c.name for c in SC.CASES if c.tp == 1]
TP_CASES = [c.name for c in SC.CASES if c.tp > 1]
GRAD_NORM_RTOL = 1e-5

pytestmark = pytest.mark.mcore


@pytest.fixture(scope="module")
def results(rank_group: Any) -> dict[str, Any]:
    per_rank = rank_group.run(SC.run_all, timeout=300)
    return {"version": per_rank[0]["version"], "ranks": [r["cases"] for r in per_rank]}


def _get(results: dict[str, Any], name: str) -> list[dict[str, Any]]:
    per_rank = [r[name] for r in results["ranks"]]
    for rank, r in enumerate(per_rank):
        if r["status"] == "error":
            pytest.fail(f"{name} on rank {rank} (megatron-core {results['version']}) raised:\n{r['error']}")
    return per_rank


@pytest.mark.parametrize("case", CASES)
def test_update_moves_weights_through_model_and_bound_buffer(results: dict[str, Any], case: str) -> None:
    for rank, r in enumerate(_get(results, case)):
        assert r["params_changed"] == r["params_total"] > 0, f"rank {rank}: {r['params_changed']} changed"
        assert r["flat_changed"] and all(r["flat_changed"]), f"rank {rank}: flat buffers {r['flat_changed']}"
        assert r["views_equal_params"], f"rank {rank}: bound views differ from the model's parameters"
        assert r["binding_verified"], r.get("binding_error")
        if case.endswith("distopt") and Version(results["version"]) >= Version("0.6"):
            assert r["binding_mode"] == "zero_copy"  # Megatron's own param buffer, nothing rebound


@pytest.mark.parametrize("case", CASES)
def test_kl_to_reference_positive_after_update_zero_when_frozen(results: dict[str, Any], case: str) -> None:
    for r in _get(results, case):
        assert r["kl_before_update"] == 0.0  # no step yet: the actor is its reference
        assert r["kl_after_update_k1_abs"] > 1e-3 and r["kl_after_update_k3"] > 1e-4
        assert r["frozen_kl"] == 0.0  # lr = 0: a step that changes nothing


@pytest.mark.parametrize("case", CASES)
def test_grad_norm_matches_plain_pytorch_reference(results: dict[str, Any], case: str) -> None:
    for rank, r in enumerate(_get(results, case)):
        ref = r["reference"]["grad_norm"]
        for got in (r["metrics"]["actor/grad_norm"], r["frozen_grad_norm"]):
            assert got == pytest.approx(ref, rel=GRAD_NORM_RTOL), f"rank {rank}: {got} vs reference {ref}"


@pytest.mark.parametrize("case", DP_CASES)
def test_grad_norm_wrong_without_finalize_hook(results: dict[str, Any], case: str) -> None:
    for rank, r in enumerate(_get(results, case)):
        ref, got = r["reference"]["grad_norm"], r["nohook_grad_norm"]
        assert abs(got - ref) > 1e-2 * ref, f"rank {rank}: {got} ~ {ref} although the hook was removed"


@pytest.mark.parametrize("case", CASES)
def test_metrics_match_reference_and_agree_across_ranks(results: dict[str, Any], case: str) -> None:
    per_rank = _get(results, case)
    for r in per_rank:
        m = r["metrics"]
        assert m["actor/pg_loss"] == pytest.approx(r["reference"]["pg_loss"], rel=1e-5)
        for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/kl_loss",
                    "actor/grad_norm"):
            assert key in m
        assert 0.0 < m["actor/pg_clipfrac"] < 1.0 and m["actor/update_successful"] == 1.0
        assert r["sft_metrics"]["actor/sft_loss"] == pytest.approx(r["sft_reference"], rel=1e-5)
    loss_keys = [k for k in per_rank[0]["metrics"] if k != "actor/grad_norm"]
    assert [per_rank[0]["metrics"][k] for k in loss_keys] == [per_rank[1]["metrics"][k] for k in loss_keys]


@pytest.mark.parametrize("case", CASES)
def test_only_rank_0_prints(results: dict[str, Any], case: str) -> None:
    rank0, rank1 = (r["stdout"] for r in _get(results, case))
    assert "ActorConfig(" in rank0 and "actor/pg_loss=" in rank0 and "actor/grad_norm=" in rank0
    assert rank1 == ""


@pytest.mark.parametrize("case", CASES)
def test_multi_modal_inputs_handled(results: dict[str, Any], case: str) -> None:
    """An empty list is ignored (every case's batch has one); a non-empty one is concatenated and ignored by
    the text-only model with one warning on rank 0 (warned once per process: the first case)."""
    per_rank = _get(results, case)
    assert all(r["mm_same_log_probs"] for r in per_rank)
    assert per_rank[1]["mm_warnings"] == []
    if case == CASES[0]:
        assert len(per_rank[0]["mm_warnings"]) == 1


@pytest.mark.parametrize("case", TP_CASES)
def test_tp_log_probs_match_megatron_vocab_parallel_cross_entropy(results: dict[str, Any], case: str) -> None:
    for r in _get(results, case):
        assert r["tp_logprob_vs_megatron_ce"] < 1e-5
