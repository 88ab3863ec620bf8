"""The self-check against the installed release, on the session's 2 gloo ranks (``rank_group``):

* the clean configurations PASS: every configuration of the standard sweep in bf16 at a typical RL learning rate
  (1e-6) and in fp32 at 1e-2 (the CLI's sweep), and the configurations whose optimizer writes the bf16 model params
  from fp32 main params by another path in bf16 at 1e-2 too, with weight decay on (no decay for biases and norms)
  and clipping active;
* every injected fault, acted where the real bug would act, FAILS naming the right check on every release where
  the fault can exist: in bf16 (the RL setting, and the looser gradient tolerance), and in fp32 too where the
  param dtype changes the code the fault acts in (the optimizer's structure: fp32 params are their own main
  params; the gradient check's fp32 tolerance); the verdicts are written to ``$MCORE_COMPAT_FAULT_REPORT`` (when set) for the
  matrix's fault-detection score (marked ``faults``: the matrix runs them in the session of each minor's latest
  listed patch, see matrix/versions.toml's header);
* ``check_training_step`` on the caller's own model passes clean and catches the faults a bug inside the
  optimizer step causes, with and without its reference copy.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from packaging.version import Version

from mcore_compat.launch import Group
from mcore_compat.selfcheck import FAULTS, Report, SelfCheckOptions, run_sweep

pytestmark = pytest.mark.mcore

DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class Fault:
    """A fault, the configuration it is injected into, and what must FAIL.

    ``must_fail``: every one of these checks fails; ``outcome``: at least one of these (a check on the training
    outcome, not only on structure) fails; ``releases``: where the fault can exist; ``fault``: the injected fault
    (default: the case's name); ``dtypes``: the parameter dtypes it is injected in.
    """

    config: dict = field(default_factory=dict)
    must_fail: frozenset = frozenset()
    outcome: frozenset = frozenset()
    releases: str = ">=0.4"
    fault: str = ""
    dtypes: tuple = DTYPES


_GRADS = frozenset({"grads_match_reference"})
_RULE = frozenset({"update_matches_optimizer_rule"})
#: Faults whose mechanism does not depend on the param dtype (a hook not installed, a param group's settings, a
#: rank perturbed, a binding broken, the gradients off by a factor or a sign) run in bf16 only: there the gradient
#: tolerance is the loosest (0.1 relative against 1e-5 in fp32), so a fault caught in bf16 is caught in fp32 by the
#: same check. Faults acting in the optimizer's structure or its buffers (rebinds, a group not stepped) and one
#: gradient fault (the fp32 tolerance path) run in both dtypes: fp32 params take another optimizer class.
_BF16 = ("bf16",)
FAULT_CASES: dict[str, Fault] = {
    "rebind_after_optimizer": Fault(dict(distributed_optimizer=True), frozenset({"params_in_ddp_buffer"}),
                                    frozenset({"model_params_match_main", "replicas_identical"}), ">=0.6"),
    "rebind_before_optimizer": Fault(dict(distributed_optimizer=True), frozenset({"params_in_ddp_buffer"}),
                                     frozenset({"model_params_match_main", "replicas_identical"}), ">=0.6"),
    "no_finalize_hook": Fault(dict(distributed_optimizer=False), frozenset({"training_hooks_installed"}), _GRADS,
                              dtypes=_BF16),
    # without the hook the norms' gradients of each sequence shard are never summed over TP (DP=1: nothing else
    # would show it) and the tied embedding never gets the output layer's gradient (and vice versa)
    "no_finalize_hook-tp2-sp": Fault(dict(tp=2, sequence_parallel=True), frozenset({"training_hooks_installed"}),
                                     _GRADS, fault="no_finalize_hook", dtypes=_BF16),
    "no_finalize_hook-pp2-tied": Fault(dict(pp=2, tie_embeddings=True), frozenset({"training_hooks_installed"}),
                                       _GRADS, fault="no_finalize_hook", dtypes=_BF16),
    "lr_zero": Fault(dict(distributed_optimizer=False), frozenset({"all_params_changed"}), dtypes=_BF16),
    "perturb_dp_rank": Fault(dict(distributed_optimizer=False), frozenset({"replicas_identical"}),
                             frozenset({"state_unchanged_between_steps"}), dtypes=_BF16),
    "rebind_after_bind": Fault(dict(distributed_optimizer=True), frozenset({"binding_verified"}),
                               frozenset({"bound_buffer_current", "model_params_match_main"}), dtypes=_BF16),
    "negate_norm_grads": Fault(dict(distributed_optimizer=True), outcome=_GRADS, dtypes=_BF16),
    "scale_grads": Fault(dict(distributed_optimizer=False), outcome=_GRADS),
    "unreduced_dp_rank": Fault(dict(distributed_optimizer=True), outcome=_GRADS, dtypes=_BF16),
    "decay_no_decay_params": Fault(dict(distributed_optimizer=True), frozenset({"param_groups_as_configured"}),
                                   dtypes=_BF16),
    "wrong_group_lr": Fault(dict(distributed_optimizer=False), frozenset({"param_groups_as_configured"}),
                            dtypes=_BF16),
    "group_not_stepped": Fault(dict(distributed_optimizer=True), frozenset({"optimizer_covers_params"}),
                               frozenset({"update_matches_optimizer_rule", "all_params_changed"})),
    "loss_not_averaged": Fault(dict(distributed_optimizer=False), outcome=_GRADS, dtypes=_BF16),
    # inside the torch optimizer's step, after every structural check: the rule's hyper-parameters come from the
    # configuration, so the update itself is off (0.4/0.5: mcore_compat's optimizer, the same torch AdamW)
    # (bf16 only: they act in the torch optimizer's step on the fp32 main params, which every param dtype has -
    # fp32 params are their own main params -, and the update check's tolerance is looser in bf16)
    "maximize_in_step": Fault(dict(distributed_optimizer=True), _RULE, dtypes=_BF16),
    "swap_betas_in_step": Fault(dict(distributed_optimizer=False), _RULE, dtypes=_BF16),
    "decay_no_decay_in_step": Fault(dict(distributed_optimizer=True), _RULE, dtypes=_BF16),
    "stale_binding": Fault(dict(distributed_optimizer=False), frozenset({"binding_verified"}),
                           frozenset({"bound_buffer_current"}), dtypes=_BF16),
    # a TP partition stride recorded wrong at bind time: gather_full puts the shards in the wrong places (bf16
    # only: the bytes moved do not depend on the dtype)
    "gather_full_wrong_stride": Fault(dict(tp=2, distributed_optimizer=True, bind=True),
                                      frozenset({"gather_full_matches"}), dtypes=("bf16",)),
    # the offload faults act inside mcore_compat.offload/reload; the dtype does not change what they do, so they
    # run in bf16 only (the setting RL runs use)
    "reload_recreates_storage": Fault(dict(distributed_optimizer=True, offload_cycles=1, bind=True),
                                      frozenset({"reload_in_place", "binding_verified"}),
                                      # what Megatron updates (0.6+), what a weight hand-off reads (every release)
                                      frozenset({"model_params_match_main", "params_in_ddp_buffer",
                                                 "bound_buffer_current"}),
                                      dtypes=("bf16",)),
    "offload_misses_optimizer_state": Fault(dict(distributed_optimizer=True, offload_cycles=1),
                                            frozenset({"offload_frees_memory"}), dtypes=("bf16",)),
    "offload_reallocates_host": Fault(dict(distributed_optimizer=False, offload_cycles=2),
                                      frozenset({"offload_host_memory_bounded"}), dtypes=("bf16",)),
}


def _installed() -> Version:
    from mcore_compat import detect

    return detect().version


def _applies(fault: str) -> bool:
    from mcore_compat._facts.ranges import in_range

    return in_range(_installed(), FAULT_CASES[fault].releases)


#: The clean configurations: the standard sweep (every configuration the release can run at world size 2) in
#: bf16 at a typical RL learning rate (1e-6); at 1e-2, where most bf16 model params move every step, the
#: configurations whose optimizer copies the fp32 main params into the bf16 model params by a path of its own:
#: the distributed optimizer (through the param buffer's gather), the plain mixed-precision optimizer, and the
#: expert-parallel one (expert buffers over their own data-parallel group). The same sweep runs whole in fp32 at
#: 1e-2 as the CLI's sweep (``CLI_SWEEP_ARGS``, below). The RL range is 1e-7 to 1e-5: 1e-2 is a stress setting.
LRS = (1e-6, 1e-2)


def _at_high_lr(c: SelfCheckOptions) -> bool:
    return (c.tp or 1) == 1 and (c.pp or 1) == 1 and not c.overlap


def _clean() -> dict[str, SelfCheckOptions]:
    from mcore_compat.selfcheck import standard_sweep

    return {f"{c.label()}-lr{lr:g}": replace(c, lr=lr) for lr in LRS for c in standard_sweep(2, dtype="bf16")
            if lr < 1e-3 or _at_high_lr(c)}


#: Adam with L2 weight decay through the moments (``decoupled_weight_decay=False``): clean in both dtypes at both
#: learning rates, where the release's OptimizerConfig has the field (0.15+).
COUPLED = {f"coupled-wd-{dtype}-lr{lr:g}": SelfCheckOptions(decoupled_weight_decay=False, dtype=dtype, lr=lr,
                                                            distributed_optimizer=dtype == "bf16")
           for dtype in DTYPES for lr in LRS}


def _coupled_unsupported() -> str | None:
    from mcore_compat.selfcheck import models

    config = next(iter(COUPLED.values()))
    return models.unsupported_reason(replace(config, nproc=2, device="cpu").resolved())


def _fault(case: str) -> str:
    return FAULT_CASES[case].fault or case


def test_every_fault_has_a_case() -> None:
    assert {_fault(c) for c in FAULT_CASES} == set(FAULTS)


#: The command line of the matrix's CLI self-check (``ci/jobs.py``); sessions not tagged ``launcher`` run its
#: configurations here, in the warm ranks, instead of through ``mcore-compat`` with freshly spawned ranks.
CLI_SWEEP_ARGS = ("--nproc", "2", "--sweep", "--device", "cpu", "--bind")


def _cli_sweep() -> dict[str, SelfCheckOptions]:
    from mcore_compat.cli.selfcheck import _sweep_configs_for

    return {f"cli-{c.label()}": c for c in _sweep_configs_for(CLI_SWEEP_ARGS)}


#: What every configuration of the module's sweeps runs: the tiny GPT, two steps.
_SWEEP: dict[str, Any] = dict(model="gpt", steps=2)


@pytest.fixture(scope="module")
def sweep(rank_group: Group) -> dict[str, Report]:
    """The clean configurations (the standard sweep, the CLI's, coupled weight decay), in the warm ranks."""
    configs = {name: replace(c, **_SWEEP) for name, c in _clean().items()}
    configs.update(_cli_sweep())
    if _coupled_unsupported() is None:
        configs.update({name: replace(c, **_SWEEP) for name, c in COUPLED.items()})
    reports = run_sweep(list(configs.values()), 2, device="cpu", timeout=1800, group=rank_group)
    out = dict(zip(configs, reports, strict=True))
    target = os.environ.get("MCORE_COMPAT_SELFCHECK_REPORT")
    if target:  # what `mcore-compat self-check ... --json` writes, for the matrix's record of this release
        with open(target, "w", encoding="utf-8") as fh:
            json.dump([json.loads(out[n].to_json()) for n in _cli_sweep()], fh, indent=2)
    return out


@pytest.fixture(scope="module")
def fault_sweep(rank_group: Group, sweep: dict[str, Report]) -> dict[str, Report]:
    """Every injected fault that can exist on this release, in its configuration and dtypes (only where the tests
    marked ``faults`` run: versions.toml's header); writes the score with the clean configurations'."""
    configs = {}
    for name, case in FAULT_CASES.items():
        if not _applies(name):
            continue
        fault = _fault(name)
        for dtype in case.dtypes:
            bind = fault in ("rebind_after_bind", "stale_binding")
            configs[f"{name}-{dtype}"] = SelfCheckOptions(fault=fault, dtype=dtype, **_SWEEP,
                                                          **{"bind": bind, **case.config})
    reports = run_sweep(list(configs.values()), 2, device="cpu", timeout=1800, group=rank_group)
    out = dict(zip(configs, reports, strict=True))
    _write_fault_report({**sweep, **out})
    return out


def test_the_cli_sweep_passes(sweep: dict[str, Report]) -> None:
    """The configurations of the matrix's CLI self-check (fp32, the CLI's defaults, bound, two offload cycles),
    built by the CLI's own option handling, pass on this release."""
    names = list(_cli_sweep())
    assert len(names) >= 3, names
    for name in names:
        report = sweep[name]
        assert report.ok, report.render()
        assert report.settings["dtype"] == "fp32" and report.settings["bind"], report.settings


def _caught(name: str, report: Report) -> bool:
    case = FAULT_CASES[name]
    failed = {c.name for c in report.failed}
    return (report.error is None and not report.ok and case.must_fail <= failed
            and (not case.outcome or bool(case.outcome & failed)))


def _write_fault_report(reports: dict[str, Report]) -> None:
    """The fault-detection score of this release (for the matrix), when the session asks for it."""
    target = os.environ.get("MCORE_COMPAT_FAULT_REPORT")
    if not target:
        return
    faults = {}
    for fault in FAULT_CASES:
        for dtype in DTYPES:
            r = reports.get(f"{fault}-{dtype}")
            if r is not None:
                faults[f"{fault}-{dtype}"] = {"caught": _caught(fault, r), "failed": [c.name for c in r.failed]}
    clean = {name: reports[name].ok for name in _clean()}
    caught = sum(v["caught"] for v in faults.values())
    with open(target, "w", encoding="utf-8") as fh:
        json.dump({"caught": caught, "faults": len(faults), "clean_pass": sum(clean.values()),
                   "clean": len(clean), "details": faults}, fh, indent=2)


@pytest.mark.parametrize("lr", LRS)
def test_clean_configurations_pass(sweep: dict[str, Report], lr: float) -> None:
    names = [n for n in _clean() if n.endswith(f"-lr{lr:g}")]
    # at least DP=2 with the distributed optimizer on and off (and PP=2 in the full sweep at the RL learning rate)
    assert len(names) >= (2 if lr > 1e-3 else 3), names
    for name in names:
        report = sweep[name]
        assert report.ok, report.render()
        applied = {c.name for c in report.checks if c.applicable}
        assert {"grads_match_reference", "update_matches_optimizer_rule",
                "all_params_changed", "param_groups_as_configured", "optimizer_covers_params",
                "state_unchanged_between_steps", "training_hooks_installed", "model_params_match_main",
                "replicas_identical", "offload_frees_memory", "reload_in_place",
                "offload_host_memory_bounded"} <= applied, report.render()
        if not report.settings["dropout"] and not report.settings["experts"]:  # N/A there, saying why
            assert "independent_reference_matches" in applied, report.render()
        s = report.settings  # gather_full at TP/PP/EP > 1 (N/A before 0.6 with experts: in no DDP buffer)
        if s["bind"] and max(s["tp"] or 1, s["pp"] or 1, s["ep"] or 1) > 1 and \
                not (s["experts"] and _installed() < Version("0.6")):
            assert "gather_full_matches" in applied, report.render()
        # each comparison states the smallest relative deviation per element it could have seen in this run
        assert "; resolution: a main param off the rule by more than " in \
            report.check("update_matches_optimizer_rule").detail, report.render()
        assert "; resolution: a gradient off the reference by more than " in \
            report.check("grads_match_reference").detail, report.render()
        # the sweep's two offload cycles: a full one, then one keeping the params that reuses its host buffers
        assert "cycle 2 reused the first cycle's buffers" in report.check("offload_host_memory_bounded").detail
        # the norm is compared wherever the configuration clips; where a release cannot clip it (MoE on 0.6/0.7,
        # see capabilities' chained_optimizer_global_clip) the sweep runs without clipping and the check says why
        if report.settings["clip_grad"] > 0:
            assert "grad_norm_matches_reference" in applied, report.render()
            assert "; resolution: a norm off the recomputed one by more than " in \
                report.check("grad_norm_matches_reference").detail, report.render()
        else:
            assert "clip_grad = 0" in report.check("grad_norm_matches_reference").detail, report.render()
    clipped = [n for n in names if sweep[n].settings["clip_grad"] > 0]
    assert clipped, names  # gradient clipping is active in at least one configuration on every release


def test_the_standard_sweep_exercises_every_part_of_finalize(sweep: dict[str, Report]) -> None:
    """DP replicas, the norms' all-reduce over TP under sequence parallelism, the tied embedding across the
    first and last stage: each appears in the replicas the clean sweep proved (where the release runs it)."""
    seen = " ".join(sweep[n].check("replicas_identical").detail for n in _clean())
    assert "data-parallel" in seen and "tied embedding/output" in seen
    if any("-sp-" in n for n in _clean()):
        assert "tensor-parallel duplicates" in seen


def test_bf16_at_a_small_learning_rate_judges_the_main_params(sweep: dict[str, Report]) -> None:
    """At lr 1e-6 the bf16 model params mostly cannot move (their spacing near 1.0 is 2^-7); the self-check
    still proves the step: every main param changed, the model params equal them cast to bf16."""
    report = sweep["tp1-pp1-distopt-bf16-lr1e-06"]
    assert report.ok, report.render()
    assert report.check("all_params_changed").passed
    assert report.check("model_params_match_main").passed
    # the report states its resolution: weight decay at lr 1e-6 (lr*wd = 1e-7 of a param per step) is below what
    # one fp32 evaluation of the rule can be told from (~3 * 2^-24 of the value), so the rule is proven whole, not
    # the decay term alone
    import re

    detail = report.check("update_matches_optimizer_rule").detail
    median = float(re.search(r"off the rule by more than (\S+) of its value", detail).group(1))
    assert 1e-7 < median < 1e-5, detail


@pytest.mark.parametrize("name", list(COUPLED))
def test_coupled_weight_decay_passes(sweep: dict[str, Report], name: str) -> None:
    """Adam with L2 decay (``g + wd*p`` through the moments) trains correctly and the self-check says so: the
    oracle takes the coupled rule from the configuration."""
    why = _coupled_unsupported()
    if why is not None:
        pytest.skip(why)
    report = sweep[name]
    assert report.ok, report.render()
    check = report.check("update_matches_optimizer_rule")
    assert check.passed and "L2 through the moments" in check.detail, report.render()


@pytest.mark.faults
@pytest.mark.parametrize(("case", "dtype"), [(c, d) for c, f in FAULT_CASES.items() for d in f.dtypes])
def test_fault_fails_the_right_check(fault_sweep: dict[str, Report], case: str, dtype: str) -> None:
    if not _applies(case):
        pytest.skip(f"{case} cannot happen on megatron-core {_installed()} (needs {FAULT_CASES[case].releases})")
    report = fault_sweep[f"{case}-{dtype}"]
    assert report.error is None, report.error
    assert _caught(case, report), report.render()


# ------------------------------------------------------------------------ check_training_step on the caller's model
@pytest.fixture(scope="module")
def own_model(rank_group: Group) -> dict[str, dict]:
    """The clean cases (``OWN_MODEL``'s passing ones)."""
    import _own_model_scenarios as scenarios

    clean = tuple(c for c, (ok, _, _) in OWN_MODEL.items() if ok)
    return rank_group.run(scenarios.run_all, args=(clean,), timeout=900)[0]


@pytest.fixture(scope="module")
def own_model_faults(rank_group: Group) -> dict[str, dict]:
    """The injected faults (``OWN_MODEL``'s failing cases: tests marked ``faults``)."""
    import _own_model_scenarios as scenarios

    faults = tuple(c for c, (ok, _, _) in OWN_MODEL.items() if not ok)
    return rank_group.run(scenarios.run_all, args=(faults,), timeout=900)[0]


#: case -> (report ok, checks that must fail, checks that must not apply)
OWN_MODEL = {
    "good": (True, set(), set()),
    "good-dropout": (True, set(), set()),
    "dropout-no-replay": (False, {"grads_match_reference"}, set()),
    "good-bf16": (True, set(), set()),
    "good-bf16-snapshot": (True, set(), set()),
    "good-pp2": (True, set(), set()),
    "fd-pp2": (True, set(), set()),
    "good-no-reference": (True, set(), {"grads_match_reference"}),
    "no-hook": (False, {"training_hooks_installed", "grads_match_reference"}, set()),
    "rebind-after-bind": (False, {"binding_verified", "bound_buffer_current"}, set()),
    "step-negate-norm-grads": (False, {"update_matches_optimizer_rule"}, {"grads_match_reference"}),
    "step-scale-grads": (False, {"grad_norm_matches_reference"}, {"grads_match_reference"}),
    "step-perturb-rank1": (False, {"update_matches_optimizer_rule"}, {"grads_match_reference"}),
    "step-group-lr": (False, {"update_matches_optimizer_rule"}, {"grads_match_reference"}),
    "step-zero-half-grad": (False, {"update_matches_optimizer_rule"}, {"grads_match_reference"}),
    # the groups changed inside the step: the rule's settings come from the optimizer's config, not the groups
    "step-maximize": (False, {"update_matches_optimizer_rule"}, {"grads_match_reference"}),
    "step-maximize-snapshot": (False, {"update_matches_optimizer_rule"}, {"grads_match_reference"}),
    "step-swap-betas": (False, {"update_matches_optimizer_rule"}, {"grads_match_reference"}),
}


@pytest.mark.parametrize("case", [c if ok else pytest.param(c, marks=pytest.mark.faults)
                                  for c, (ok, _, _) in OWN_MODEL.items()])
def test_check_training_step_on_own_model(request: pytest.FixtureRequest, case: str) -> None:
    ok, must_fail, not_applicable = OWN_MODEL[case]
    result = request.getfixturevalue("own_model" if ok else "own_model_faults")[case]
    assert result["ok"] is ok, result["text"]
    statuses = result["checks"]
    assert {n for n, s in statuses.items() if s == "FAIL"} >= must_fail, result["text"]
    # the float64 model written from the math stands for the self-check's own model only (own_model.py says why);
    # the finite-difference checks run only when asked for (finite_differences=True: tests/test_megatron_faults.py)
    asked = {"grads_match_directional_derivatives", "loss_matches_float64"} if case == "fd-pp2" else set()
    assert {n for n, s in statuses.items() if s == "N/A"} == not_applicable | {
        "independent_reference_matches", "grads_match_directional_derivatives", "loss_matches_float64"} - asked, \
        result["text"]
    assert {"training_hooks_installed", "update_matches_optimizer_rule", "grad_norm_matches_reference",
            "model_params_match_main", "binding_verified", "bound_buffer_current"} <= set(statuses)
    if case == "good-pp2":
        assert statuses["pipeline_gather_matches"] == "PASS"
    if case == "fd-pp2":  # through the pipeline: each stage's float64 copy, activations sent between stages
        assert result["settings"]["finite_differences"] is True
        assert statuses["grads_match_directional_derivatives"] == statuses["loss_matches_float64"] == "PASS"
    if case == "good":
        # one step: the reference's params are views of the model's weights (no copy; buffers only, none here)
        assert result["settings"]["reference_bytes"] == 0 and result["settings"]["snapshot_bytes"] > 0
    if case.startswith("good"):
        # torch's Adam updates each element on its own: the update is checked inside the step, part by part,
        # unless switched off
        checked = result["settings"]["update_checked"]
        assert checked == ("from a snapshot of the whole state (MCORE_COMPAT_STREAM=0)" if "snapshot" in case
                           else "inside the optimizer step, in 4 parts"), checked
    if case == "good-dropout":
        # the reference replayed the step's dropout masks, and put the random state back where the step left it:
        # the same as after the same step unchecked (the step itself moved it: dropout drew masks)
        assert statuses["grads_match_reference"] == "PASS", result["text"]
        assert result["rng_moved"] and result["rng_as_unchecked"] is True, result
    if case == "dropout-no-replay":
        assert {n for n, s in statuses.items() if s == "FAIL"} == {"grads_match_reference"}, result["text"]


def test_tied_embedding_with_biases_trains_or_is_refused_before_anything_is_built(rank_group: Group) -> None:
    """PP=2, tied embeddings, linear biases, the distributed optimizer: where the release lays the tied weight over
    two gradient buckets (0.7-0.12: Megatron's DistributedOptimizer then stops with an AssertionError, shown here
    by the same build with the check switched off), wrap_ddp refuses on every stage before anything is built,
    naming the ways out; elsewhere DDP and the optimizer build."""
    import _own_model_scenarios as scenarios

    from mcore_compat.layout import layout_fact

    got = rank_group.run(scenarios.tied_bias_buckets, timeout=600)
    assert all(g["biases"] > 0 for g in got), got
    mode = layout_fact("shared_embedding_split", _installed())
    if mode == "dp_align_then_close" or any(g["refused"] for g in got):
        assert mode in ("close_at_start", "dp_align_then_close"), (mode, got)
        for g in got:
            assert g["refused"] and "Nothing was built" in g["refused"] and "use_distributed_optimizer=False" in \
                g["refused"] and not g["rebound"] and not g["optimizer"], g
        assert any("each param only belongs to a single bucket" in g.get("unchecked", "") for g in got), got
    else:
        assert all(g["optimizer"] and g["refused"] is None for g in got), got


# -------------------------------------------------- world size 4: TP=2 x PP=2, DP=2 x PP=2 (tied), DP=2 x TP=2 (SP)
WORLD4 = {
    "tp2-sp-pp2-distopt": SelfCheckOptions(tp=2, pp=2, distributed_optimizer=True, model="gpt", steps=2),
    "dp2-pp2-tied-distopt-bf16": SelfCheckOptions(tp=1, pp=2, distributed_optimizer=True, model="gpt", steps=2,
                                                  dtype="bf16", lr=1e-6),
    "dp2-tp2-sp-distopt-bf16": SelfCheckOptions(tp=2, pp=1, distributed_optimizer=True, model="gpt", steps=2,
                                                dtype="bf16"),
}


def _why_not(config: SelfCheckOptions, nproc: int) -> str | None:
    from mcore_compat.selfcheck import models

    return models.unsupported_reason(replace(config, nproc=nproc, device="cpu").resolved())


@pytest.fixture(scope="module")
def world4_group() -> Iterator[Group]:
    from conftest import WARM_CPU

    with Group(4, device="cpu", destroy_subgroups=True, warm=WARM_CPU) as group:
        yield group


@pytest.fixture(scope="module")
def world4(world4_group: Group) -> dict[str, Report]:
    runnable = {n: c for n, c in WORLD4.items() if _why_not(c, 4) is None}
    return dict(zip(runnable, run_sweep(list(runnable.values()), 4, device="cpu", timeout=900, group=world4_group),
                    strict=True))


def test_own_optimizer_refuses_tied_embeddings_it_would_train_wrong(world4_group: Group) -> None:
    """0.4/0.5 (mcore_compat's optimizer): DP=2 x PP=2 with tied embeddings and the distributed optimizer is
    refused with a clear error (their DDP would sum the two stages' embedding gradients unaligned); from 0.6
    Megatron's optimizer builds it (and the self-check proves its training above)."""
    import _own_model_scenarios as scenarios

    from mcore_compat._facts.ranges import in_range

    messages = world4_group.run(scenarios.legacy_tied_refusal, timeout=600)
    if in_range(_installed(), "<0.6"):
        assert all(m and "tied across pipeline stages" in m and "use_distributed_optimizer=False" in m
                   for m in messages), messages
    else:
        assert messages == [None] * 4


@pytest.mark.parametrize("name", list(WORLD4))
def test_world_size_4_pipeline_with_binding(world4: dict[str, Report], name: str) -> None:
    if name not in world4:
        pytest.skip(f"release limit: {_why_not(WORLD4[name], 4)}")
    report = world4[name]
    assert report.ok, report.render()
    passed = {c.name for c in report.checks if c.passed}
    assert {"binding_verified", "bound_buffer_current", "update_matches_optimizer_rule", "grads_match_reference",
            "grad_norm_matches_reference", "replicas_identical", "gather_full_matches"} <= passed, report.render()
    if "-pp2-" in name:
        assert "pipeline_gather_matches" in passed


def test_sweep_refuses_a_group_that_does_not_match(rank_group: Group) -> None:
    """A sweep for 4 ranks handed the session's 2-rank group: a clear error before anything runs."""
    from mcore_compat.selfcheck import UsageError

    with pytest.raises(UsageError, match=r"the group has 2 rank.*asks for 4"):
        run_sweep(list(WORLD4.values()), 4, device="cpu", group=rank_group)
