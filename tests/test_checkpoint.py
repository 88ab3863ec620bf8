"""Checkpoints (``mcore_compat.save_checkpoint`` / ``load_checkpoint``): exact resume in every release session,
resharding over data-parallel size, refusals that leave the model and optimizer untouched.

ONE module-scoped ``run_all`` on the session's 2 gloo ranks (tests/_checkpoint_scenarios.py); the tests assert.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import _checkpoint_scenarios as SCENARIOS
import pytest
from conftest import case_results, run_scenarios

RESUME = [n for n in SCENARIOS.CASE_NAMES if n.startswith("resume-")]


@pytest.fixture(scope="module")
def keep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoint-keep")


@pytest.fixture(scope="module")
def results(rank_group: Any, keep: Path) -> dict[str, Any]:
    return run_scenarios(rank_group, functools.partial(SCENARIOS.run_all, keep=str(keep)), timeout=600)


def _case(results: dict[str, Any], name: str) -> list[dict[str, Any]]:
    per_rank = case_results(results, name)
    if per_rank[0]["status"] == "unsupported":
        pytest.skip(f"release limit of megatron-core {results['version']}: {per_rank[0]['reason']}")
    return per_rank


@pytest.mark.mcore
@pytest.mark.parametrize("name", RESUME)
def test_resume_is_exact(results: dict[str, Any], name: str) -> None:
    for r in _case(results, name):
        assert r["differs_before"] > 0  # the fresh build really started elsewhere
        assert r["after_load"] == [], r["after_load"]  # weights, main params, both moments, step: as saved
        assert r["n_state"] >= 3  # Adam's exp_avg, exp_avg_sq and step were among the values compared
        assert r["fresh_tail"] == r["tail"], (r["fresh_tail"], r["tail"])  # the loss curve, bit for bit
        assert r["final_diff"] == [], r["final_diff"]  # and everything after M more steps
        assert r["iteration"] == SCENARIOS.K and r["extra"] == {"seen": SCENARIOS.K} and r["rng_restored"]


@pytest.mark.mcore
def test_a_dropped_moment_is_caught(results: dict[str, Any]) -> None:
    """The resume comparison can fail: a loader that drops exp_avg is named by it (every main param's exp_avg)."""
    for r in _case(results, "fault-dropped-moment"):
        assert r["after_load"] and all(k.startswith("state:") and k.endswith(".exp_avg") for k in r["after_load"]), \
            r["after_load"]


@pytest.mark.mcore
def test_reshard_distributed_optimizer_on_off(results: dict[str, Any]) -> None:
    for r in _case(results, "reshard"):
        assert r["dp2-distopt-bf16->dp2-plain-fp32"] == [], r["dp2-distopt-bf16->dp2-plain-fp32"]
        assert r["dp2-plain-fp32->dp2-distopt-bf16"] == [], r["dp2-plain-fp32->dp2-distopt-bf16"]
        assert r["tp_refusal"] and r["tp_refusal"].startswith("CheckpointReshardError") \
            and "TP 1 -> 2" in r["tp_refusal"] and "mcore_compat.torch" in r["tp_refusal"], r["tp_refusal"]
        assert r["tp_unchanged"] == [], r["tp_unchanged"]


@pytest.mark.mcore
def test_reshard_dp2_to_dp1(results: dict[str, Any], keep: Path) -> None:
    """Saved at DP=2 with the distributed optimizer, loaded on one rank (DP=1) with and without it: every weight,
    main param, moment and step as saved; the RNG states are not restored (another layout), and it trains on."""
    from conftest import WARM_CPU

    from mcore_compat.launch import Group

    _case(results, "reshard")
    with Group(1, device="cpu", destroy_subgroups=True, warm=WARM_CPU) as group:
        (out,) = group.run(functools.partial(SCENARIOS.load_at_dp1, str(keep)), timeout=300)
    for mode, r in out.items():
        assert r["diff"] == [] and not r["rng_restored"] and r["trains"], (mode, r)


BAD = {"truncated": "CheckpointFormatError", "corrupt": "CheckpointFormatError", "foreign": "CheckpointFormatError",
       "in_progress": "CheckpointInProgressError", "missing_shard": "CheckpointFormatError",
       "other_model": "CheckpointMismatchError", "other_dtype": "CheckpointMismatchError"}


@pytest.mark.mcore
@pytest.mark.parametrize("tag", list(BAD))
def test_bad_checkpoint_refused_and_nothing_loaded(results: dict[str, Any], tag: str) -> None:
    for r in _case(results, "bad-input"):
        assert r[tag] is not None and r[tag].startswith(BAD[tag]), r[tag]
        assert "\n" not in r[tag]
        unchanged = r["unchanged"] if tag not in ("other_model", "other_dtype") else r[f"{tag}_unchanged"]
        assert unchanged == [], unchanged
