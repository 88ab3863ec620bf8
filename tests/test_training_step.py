"""The training-step API against the installed megatron-core: one step through mcore_compat equals plain
PyTorch.

ONE module-scoped ``run_all`` on the session's 2 gloo ranks (``rank_group``) runs every configuration (tests/_training_scenarios.py) in one gloo group;
the tests below are parametrised over the configurations and only assert. ``broadcast_params`` has a second,
smaller run (``run_broadcast``: every case in one call) at the end of this file.

Reference: the unsharded model, the same initial weights and data (all DP ranks' microbatches), mean loss,
``clip_grad_norm_`` and ``torch.optim.AdamW``. Tolerances:

* fp32 params: loss and grad norm relative 1e-5; every parameter's update absolute 1e-6 (updates are ~1e-2).
* bf16 params (fp32 main params and grads): loss and grad norm relative 1e-2 (bf16 forward/backward); every
  updated parameter within one bf16 rounding of the reference, ``|p - p_ref| <= 2**-8 |p_ref| + 1e-4`` (a sign
  flip of an Adam update would be ~2e-2).
"""

from __future__ import annotations

import math
from typing import Any

import _training_scenarios as SCENARIOS
import pytest
from conftest import case_results, run_scenarios
from packaging.version import Version

from mcore_compat._facts.ranges import in_range
from mcore_compat.errors import InvalidArgumentError, UnsupportedVersionError
from mcore_compat.training.ddp import DDPConfig, ddp_config_of
from mcore_compat.training.optimizer import OptimConfig

CASES = [c.name for c in SCENARIOS.cases() if c.hooks]
DP2_CASES = [c.name for c in SCENARIOS.cases() if c.hooks and c.dp == 2]

#: Configurations that must raise UnsupportedVersionError (ignoring the explicit one-rank DP group would change
#: the result): 0.8-0.12 DDP takes its DP group from parallel_state only; the distributed optimizer reduces its
#: grad norm over the world before 0.15 (from 0.15 the group can be passed).
EXPECTED_UNSUPPORTED: tuple[tuple[str, frozenset[str]], ...] = (
    (">=0.8,<0.13", frozenset(c for c in CASES if c.startswith("dp1-"))),
    (">=0.6,<0.8", frozenset(c for c in CASES if c.startswith("dp1-distopt"))),
    (">=0.13,<0.15", frozenset(c for c in CASES if c.startswith("dp1-distopt"))),
)

TOL = {"fp32": {"loss": 1e-5, "grad_norm": 1e-5, "update_atol": 1e-6},
       "bf16": {"loss": 1e-2, "grad_norm": 1e-2, "rtol": 2.0**-8, "atol": 1e-4}}


# ---------------------------------------------------------------------------------------------------------------
# unit tests (no megatron-core needed)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.unit
def test_ddp_settings_translate_to_pre_0_7_keyword_arguments() -> None:
    kwargs = ddp_config_of({"grad_reduce_in_fp32": True, "use_distributed_optimizer": True}, Version("0.5.0"))
    assert kwargs == {"accumulate_allreduce_grads_in_fp32": True, "overlap_grad_reduce": False,
                      "use_distributed_optimizer": True, "bucket_size": 40_000_000}
    assert "check_for_nan_in_grad" in ddp_config_of(DDPConfig(), Version("0.6.0"))


@pytest.mark.unit
def test_ddp_settings_a_release_cannot_honour_raise_or_warn() -> None:
    with pytest.raises(UnsupportedVersionError, match=r"num_distributed_optimizer_instances.* exists in v >= 0\.10"):
        ddp_config_of(DDPConfig(num_distributed_optimizer_instances=2), Version("0.6.0"))
    with pytest.raises(UnsupportedVersionError, match="DistributedDataParallelConfig"):
        ddp_config_of(DDPConfig(extra={"nccl_ub": True}), Version("0.6.0"))
    from mcore_compat.rank0 import reset_warn_once

    reset_warn_once()
    with pytest.warns(UserWarning, match="average_in_collective"):
        ddp_config_of(DDPConfig(average_in_collective=True), Version("0.6.0"))


@pytest.mark.unit
def test_configs_accept_mappings_and_foreign_dataclasses() -> None:
    cfg = OptimConfig.from_any({"lr": 1e-3, "bf16": True, "muon_momentum": 0.9})
    assert (cfg.lr, cfg.bf16, cfg.extra) == (1e-3, True, {"muon_momentum": 0.9})
    assert DDPConfig.from_any(DDPConfig(overlap_grad_reduce=True)).overlap_grad_reduce


@pytest.mark.unit
def test_ddp_config_refuses_both_names_of_grad_reduce_in_fp32_with_different_values() -> None:
    assert DDPConfig.from_any({"accumulate_allreduce_grads_in_fp32": True}).grad_reduce_in_fp32
    assert DDPConfig.from_any({"accumulate_allreduce_grads_in_fp32": True, "grad_reduce_in_fp32": True}) \
        .grad_reduce_in_fp32
    with pytest.raises(InvalidArgumentError, match="accumulate_allreduce_grads_in_fp32=True and "
                                                   "grad_reduce_in_fp32=False"):
        DDPConfig.from_any({"accumulate_allreduce_grads_in_fp32": True, "grad_reduce_in_fp32": False})


# ---------------------------------------------------------------------------------------------------------------
# against the installed release: one run on the session's ranks for everything
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def results(rank_group: Any) -> dict[str, Any]:
    return run_scenarios(rank_group, SCENARIOS.run_all, timeout=300)


def _expected_unsupported(version: str) -> frozenset[str]:
    out: frozenset[str] = frozenset()
    for spec, names in EXPECTED_UNSUPPORTED:
        if in_range(version, spec):
            out |= names
    return out


def _flat(params: dict[str, Any]) -> dict[str, list[float]]:
    def flatten(x: Any) -> list[float]:
        return [v for item in x for v in flatten(item)] if isinstance(x, list) else [x]

    return {k: flatten(v) for k, v in params.items()}


@pytest.mark.mcore
@pytest.mark.parametrize("name", CASES)
def test_step_matches_plain_pytorch(results: dict[str, Any], name: str) -> None:
    version = results["version"]
    per_rank = case_results(results, name)
    if name in _expected_unsupported(version):
        for r in per_rank:
            assert r["status"] == "unsupported", f"{name} should be refused on {version}: {r}"
            assert "cannot" in r["error"] or "!=" in r["error"]
        return
    tol = TOL["bf16" if name.endswith("bf16") else "fp32"]
    for r in per_rank:
        assert r["status"] == "ok", f"{name} on {version} rank {r['rank']}: {r.get('error')}"
        assert r["update_successful"]
        assert math.isclose(r["loss"], r["ref_loss"], rel_tol=tol["loss"]), (r["loss"], r["ref_loss"])
        assert r["grad_norm"] is not None
        assert math.isclose(r["grad_norm"], r["ref_grad_norm"], rel_tol=tol["grad_norm"]), \
            (r["grad_norm"], r["ref_grad_norm"])
        assert all(r["changed"].values()), f"parameters that did not move: {r['changed']}"
        got, ref, init = _flat(r["params"]), _flat(r["ref_params"]), _flat(r["init_params"])
        for key in got:
            if "update_atol" in tol:
                err = max(abs((g - i) - (p - i)) for g, p, i in zip(got[key], ref[key], init[key], strict=True))
                assert err <= tol["update_atol"], f"{name} rank {r['rank']} {key}: update error {err:.3g}"
            else:
                bad = [(g, p) for g, p in zip(got[key], ref[key], strict=True)
                       if abs(g - p) > tol["rtol"] * abs(p) + tol["atol"]]
                assert not bad, f"{name} rank {r['rank']} {key}: {len(bad)} elements off, e.g. {bad[:3]}"


@pytest.mark.mcore
@pytest.mark.parametrize("name", DP2_CASES)
def test_dp_ranks_identical_after_step(results: dict[str, Any], name: str) -> None:
    r0, r1 = case_results(results, name)
    if name in _expected_unsupported(results["version"]):
        pytest.skip(f"release limit: megatron-core {results['version']} cannot run {name} (refused as unsupported; "
                    f"test_step_matches_plain_pytorch checks the refusal)")
    assert r0["status"] == r1["status"] == "ok", (r0.get("error"), r1.get("error"))
    assert r0["dp_rank"] != r1["dp_rank"], "the two ranks should be different DP ranks with different data"
    assert r0["params"] == r1["params"]


@pytest.mark.mcore
def test_missing_finalize_hook_is_silently_wrong_with_raw_megatron(results: dict[str, Any]) -> None:
    """Reproduces the silent failure: Megatron's own schedule with finalize_model_grads_func unset at DP=2 with
    different data per rank runs without error, but nothing is reduced over DP: the grad norm is each rank's local
    norm, the update differs from the reference and the DP replicas diverge."""
    r0, r1 = case_results(results, "dp2-nohook-fp32")
    for r in (r0, r1):
        assert r["status"] == "ok" and r["finalize_hook_set"] is False
        assert math.isclose(r["main_grad_norm"], r["grad_norm"], rel_tol=1e-4)  # the optimizer saw local grads
        assert abs(r["grad_norm"] - r["ref_grad_norm"]) / r["ref_grad_norm"] > 0.05, r
        assert max(r["update_err"].values()) > 1e-3
    assert r0["params"] != r1["params"], "without the hook the DP replicas diverge"


@pytest.mark.mcore
def test_check_training_hooks_raises_when_finalize_missing(results: dict[str, Any]) -> None:
    for r in case_results(results, "dp2-nohook-fp32"):
        check_error, forward_backward_error = r["check_errors"]
        assert check_error is not None and "finalize_model_grads_func" in check_error
        assert forward_backward_error is not None and "install_training_hooks" in forward_backward_error


# ---------------------------------------------------------------------------------------------------------------
# broadcast_params: one more run on the session's ranks, every case in it
# ---------------------------------------------------------------------------------------------------------------

#: Where Megatron's own DistributedDataParallel.broadcast_params raises AttributeError (it reads
#: self.data_parallel_group, which the constructor never sets).
MEGATRON_BROADCAST_BROKEN = ">=0.6,<0.8"
#: Where it broadcasts every parameter over parallel_state's DP group, ignoring the DDP's own groups.
MEGATRON_BROADCAST_ONE_GROUP = "<0.6"
#: Where wrap_ddp refuses an explicit DP group (the DDP reads parallel_state's) and "explicit-dp1" cannot run.
EXPLICIT_GROUP_REFUSED = ">=0.8,<0.13"
#: Where DDP keeps param buffers (param_data) with the distributed optimizer.
PARAM_BUFFERS = ">=0.6"


@pytest.fixture(scope="module")
def broadcast(rank_group: Any) -> dict[str, Any]:
    per_rank = rank_group.run(SCENARIOS.run_broadcast, timeout=300)
    return {"version": per_rank[0]["version"], "ranks": per_rank}


def _broadcast_case(broadcast: dict[str, Any], name: str) -> list[dict[str, Any]] | None:
    """Both ranks' results of ``name``, or None where the release refuses the case (asserted here)."""
    version = broadcast["version"]
    per_rank = [r["cases"][name] for r in broadcast["ranks"]]
    for r in per_rank:
        if r["status"] == "error":
            pytest.fail(f"broadcast case {name} on rank {r['rank']} raised:\n{r['error']}")
    if name == "explicit-dp1" and in_range(version, EXPLICIT_GROUP_REFUSED):
        for r in per_rank:
            assert r["status"] == "unsupported" and "cannot be honoured" in r["error"], r
        return None
    for r in per_rank:
        assert r["status"] == "ok", r
    return per_rank


def _synced(name: str, param: str) -> bool:
    """Whether ``param`` is broadcast over both ranks in case ``name`` (else each rank is its own group)."""
    if name == "explicit-dp1":
        return False
    return not (name == "dp2-ep2" and param.startswith(SCENARIOS.EXPERT_PREFIX))


@pytest.mark.mcore
@pytest.mark.parametrize("name", SCENARIOS.BROADCAST_CASES)
def test_broadcast_params_copies_rank_0_over_the_ddp_groups(broadcast: dict[str, Any], name: str) -> None:
    per_rank = _broadcast_case(broadcast, name)
    if per_rank is None:
        pytest.skip(f"release limit: megatron-core {broadcast['version']} DDP takes its DP group from "
                    f"parallel_state only (wrap_ddp refuses an explicit one; asserted above)")
    r0, r1 = per_rank
    for key in r0["before"]:
        assert r0["before"][key] != r1["before"][key], f"{key}: rank 1 was not perturbed, the test cannot fail"
        assert r0["after"][key] == r0["before"][key], f"{key}: rank 0's values changed"
        source = "rank 0's" if _synced(name, key) else "its own"
        want = r0["before"][key] if _synced(name, key) else r1["before"][key]
        assert r1["after"][key] == want, f"{name} {key}: rank 1 does not hold {source} values"


@pytest.mark.mcore
@pytest.mark.parametrize("name", SCENARIOS.BROADCAST_CASES)
def test_broadcast_params_keeps_params_views_of_ddp_buffers(broadcast: dict[str, Any], name: str) -> None:
    per_rank = _broadcast_case(broadcast, name)
    if per_rank is None:
        pytest.skip(f"release limit: megatron-core {broadcast['version']} cannot run {name} (asserted refused)")
    for r in per_rank:
        if in_range(broadcast["version"], PARAM_BUFFERS):
            assert r["alias_checked"] == len(r["before"]), r
        else:
            assert r["alias_checked"] == 0
        assert r["alias_bad"] == [], f"params no longer views of DDP's param_data: {r['alias_bad']}"


@pytest.mark.mcore
@pytest.mark.parametrize("name", SCENARIOS.BROADCAST_CASES)
def test_megatron_broadcast_params_is_called_exactly_where_it_is_right(broadcast: dict[str, Any],
                                                                      name: str) -> None:
    """Megatron's own method, called directly: AttributeError on 0.6/0.7; on 0.4/0.5 it broadcasts everything
    over parallel_state's DP group (wrong for expert params and for an explicit group). mcore_compat calls it
    exactly where it gives the right result, and then gives the same result."""
    version = broadcast["version"]
    per_rank = _broadcast_case(broadcast, name)
    if per_rank is None:
        pytest.skip(f"release limit: megatron-core {version} cannot run {name} (asserted refused)")
    broken = in_range(version, MEGATRON_BROADCAST_BROKEN)
    one_group = in_range(version, MEGATRON_BROADCAST_ONE_GROUP)
    for r in per_rank:
        if broken:
            assert r["raw_error"] is not None and r["raw_error"].startswith("AttributeError") \
                and "data_parallel_group" in r["raw_error"], r["raw_error"]
            assert r["megatron_calls"] == 0
        else:
            assert r["raw_error"] is None, r["raw_error"]
    r0, r1 = per_rank
    if broken:
        return
    if one_group and name != "dp2":
        assert r1["raw"] == r0["before"], "0.4/0.5 broadcast_params syncs every param over parallel_state's group"
        assert r1["raw"] != r1["after"], "mcore_compat must not do what Megatron's method does here"
        assert r0["megatron_calls"] == r1["megatron_calls"] == 0
    else:
        assert r0["megatron_calls"] == r1["megatron_calls"] == 1
        assert r0["raw"] == r0["after"] and r1["raw"] == r1["after"]


@pytest.mark.mcore
def test_broadcast_params_refuses_a_module_not_wrapped_in_ddp(broadcast: dict[str, Any]) -> None:
    for r in broadcast["ranks"]:
        err = r["not_wrapped"]
        assert err["type"] == "InvalidTypeError" and err["compat"], err
        assert "chunk 1 (Linear)" in err["message"] and "wrap_ddp" in err["message"]
