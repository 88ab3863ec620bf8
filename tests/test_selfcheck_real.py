"""The self-check against the installed release: the standard sweep passes, and every negative control FAILS
naming the right check (on the session's 2 gloo ranks, ``rank_group``; world size 4 in its own group)."""

from __future__ import annotations

import pytest
from packaging.version import Version

from mcore_compat.launch import Group
from mcore_compat.selfcheck import Report, SelfCheckOptions, run_sweep, standard_sweep

pytestmark = pytest.mark.mcore

#: fault -> (configuration, checks that must fail, releases where the fault can exist)
NEGATIVE = {
    "rebind_after_optimizer": (dict(distributed_optimizer=True), {"all_params_changed", "params_in_ddp_buffer"},
                               ">=0.6"),
    "rebind_before_optimizer": (dict(distributed_optimizer=True), {"params_in_ddp_buffer"}, ">=0.6"),
    "no_finalize_hook": (dict(distributed_optimizer=False),
                         {"training_hooks_installed", "grad_norm_matches_reference"}, ">=0.4"),
    "lr_zero": (dict(distributed_optimizer=False), {"all_params_changed", "update_matches_reference"}, ">=0.4"),
    "perturb_dp_rank": (dict(distributed_optimizer=False), {"dp_ranks_identical"}, ">=0.4"),
    "rebind_after_bind": (dict(distributed_optimizer=True, bind=True), {"binding_verified", "bound_buffer_current"},
                          ">=0.4"),
}


def _installed() -> Version:
    from mcore_compat import detect

    return detect().version


def _negatives() -> list[str]:
    from mcore_compat._ranges import in_range

    return [f for f, (_, _, spec) in NEGATIVE.items() if in_range(_installed(), spec)]


@pytest.fixture(scope="module")
def sweep(rank_group: Group) -> dict[str, Report]:
    positive = standard_sweep(2, model="gpt", steps=2)
    positive.append(SelfCheckOptions(tp=1, distributed_optimizer=True, dtype="bf16", model="gpt", steps=2))
    negative = [SelfCheckOptions(tp=1, model="mlp", steps=2, fault=f, **{"bind": False, **NEGATIVE[f][0]})
                for f in _negatives()]
    reports = run_sweep(positive + negative, 2, device="cpu", timeout=900, group=rank_group)
    names = [f"tp{c.tp or 1}-pp{c.pp or 1}-{'distopt' if c.distributed_optimizer else 'plain'}-{c.dtype}"
             for c in positive]
    return dict(zip(names + [c.fault for c in negative], reports, strict=True))


@pytest.mark.parametrize("name", ["tp1-pp1-distopt-fp32", "tp1-pp1-plain-fp32", "tp2-pp1-distopt-fp32",
                                  "tp2-pp1-plain-fp32", "tp1-pp2-distopt-fp32", "tp1-pp1-distopt-bf16"])
def test_standard_configuration_passes(sweep: dict[str, Report], name: str) -> None:
    report = sweep[name]
    assert report.ok, report.render()
    names = {c.name for c in report.checks}
    assert {"all_params_changed", "update_matches_reference", "grad_norm_matches_reference",
            "dp_ranks_identical", "training_hooks_installed", "binding_verified", "bound_buffer_current"} <= names
    if "-pp2-" in name:
        assert "pipeline_gather_matches" in names


@pytest.mark.parametrize("fault", list(NEGATIVE))
def test_negative_control_fails_the_right_check(sweep: dict[str, Report], fault: str) -> None:
    if fault not in sweep:
        pytest.skip(f"{fault} cannot happen on megatron-core {_installed()} (needs {NEGATIVE[fault][2]})")
    report = sweep[fault]
    assert report.error is None, report.error
    failed = {c.name for c in report.failed()}
    assert not report.ok
    assert NEGATIVE[fault][1] <= failed, report.render()


# ------------------------------------------------------------------------ check_training_step on the caller's model
@pytest.fixture(scope="module")
def own_model(rank_group: Group) -> dict[str, dict]:
    scenarios = pytest.importorskip("_own_model_scenarios")
    return rank_group.run(scenarios.run_all, timeout=600)[0]


#: case -> (report ok, checks that must be present and fail)
OWN_MODEL = {
    "good": (True, set()),
    "good-pp2": (True, set()),
    "no-hook": (False, {"training_hooks_installed"}),
    "rebind-after-bind": (False, {"binding_verified", "bound_buffer_current"}),
}


@pytest.mark.parametrize("case", list(OWN_MODEL))
def test_check_training_step_on_own_model(own_model: dict[str, dict], case: str) -> None:
    result = own_model[case]
    ok, must_fail = OWN_MODEL[case]
    assert result["ok"] is ok, result["text"]
    assert {n for n, passed in result["checks"].items() if not passed} >= must_fail, result["text"]
    assert {"training_hooks_installed", "all_params_changed", "dp_ranks_identical", "binding_verified",
            "bound_buffer_current"} <= set(result["checks"])
    if case == "good-pp2":
        assert result["checks"]["pipeline_gather_matches"]


# ---------------------------------------------------------------------------- world size 4: TP=2 x PP=2, DP=2 x PP=2
WORLD4 = {
    "tp2-pp2-distopt": SelfCheckOptions(tp=2, pp=2, distributed_optimizer=True, model="gpt", steps=2),
    "dp2-pp2-plain": SelfCheckOptions(tp=1, pp=2, distributed_optimizer=False, model="gpt", steps=2),
}


@pytest.fixture(scope="module")
def world4() -> dict[str, Report]:
    return dict(zip(WORLD4, run_sweep(list(WORLD4.values()), 4, device="cpu", timeout=900), strict=True))


@pytest.mark.parametrize("name", list(WORLD4))
def test_world_size_4_pipeline_with_binding(world4: dict[str, Report], name: str) -> None:
    report = world4[name]
    assert report.ok, report.render()
    passed = {c.name for c in report.checks if c.passed}
    assert {"pipeline_gather_matches", "binding_verified", "bound_buffer_current", "update_matches_reference",
            "grad_norm_matches_reference", "dp_ranks_identical"} <= passed, report.render()


def test_sweep_refuses_a_group_that_does_not_match(rank_group: Group) -> None:
    """A sweep for 4 ranks handed the session's 2-rank group: a clear error before anything runs."""
    from mcore_compat.selfcheck import UsageError

    with pytest.raises(UsageError, match=r"the group has 2 rank.*asks for 4"):
        run_sweep(list(WORLD4.values()), 4, device="cpu", group=rank_group)
