"""Parameter groups with one meaning on every release: the effective (lr, weight decay) of every parameter.

The same inputs (the self-check's GPT, ``lr=1e-5``, ``min_lr=1e-6``, ``weight_decay=0.1``; no-decay and lr-scale
conditions, a decoupled learning rate, the skip-embedding rule) must give every parameter the same learning rate
and weight decay on every release 0.4 ... 0.19, right after ``get_megatron_optimizer`` (no scheduler) and at
every step of ``optimizer_param_scheduler``. The expectation is computed here from the inputs alone, so it is
one table for all 23 release sessions. Megatron's own builders (0.6+) only record ``wd_mult``/``lr_mult``/
``max_lr`` and leave the effective values to a scheduler, and from 0.16 its scheduler ignores ``lr_mult``.

A decay-only step (zero gradients, fp32, distributed optimizer off and on) leaves biases and norms exactly
unchanged and multiplies every other weight by ``1 - lr * wd`` exactly; the injected fault (group weight decay
reset to the configured value, what 0.6+ left without a scheduler) must be caught by the same check.
"""

from __future__ import annotations

import math
from typing import Any

import _param_group_scenarios as S
import pytest

from mcore_compat.capabilities import has


@pytest.fixture(scope="module")
def results(rank_group: Any) -> list[dict[str, Any]]:
    return rank_group.run(S.run_all, timeout=600)


def _rules(case: str, name: str, shape: list[int]) -> tuple[float, float, float, float]:
    """``(max_lr, min_lr, lr_mult, wd_mult)`` of a parameter, from the case's inputs."""
    default_no_wd = name.endswith(".bias") or len(shape) == 1
    if case.startswith("conds"):
        no_wd = S.no_decay_biases_only(name, None)
        decoupled = "word_embeddings" in name or "output_layer" in name
        mult = S.LR_MULT if S.scale_lr(name, None) else 1.0
    elif case == "skip-embedding":
        no_wd, decoupled, mult = default_no_wd or "embedding" in name, False, 1.0
    else:
        no_wd, decoupled, mult = default_no_wd, False, 1.0
    max_lr, min_lr = (S.DECOUPLED_LR, S.DECOUPLED_MIN_LR) if decoupled else (S.LR, S.MIN_LR)
    return max_lr, min_lr, mult, 0.0 if no_wd else 1.0


def _scheduled_lr(step: int, max_lr: float, min_lr: float) -> float:
    sch = S.SCHEDULE
    warmup, decay = int(sch["lr_warmup_steps"]), int(sch["lr_decay_steps"])
    if step <= warmup:
        return float(sch["init_lr"]) + (max_lr - float(sch["init_lr"])) * step / warmup
    if step > decay:
        return min_lr
    ratio = (step - warmup) / (decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (max_lr - min_lr)


def _scheduled_wd(step: int) -> float:
    sch = S.SCHEDULE
    start, end, steps = float(sch["start_wd"]), float(sch["end_wd"]), int(sch["wd_incr_steps"])
    return end if step > steps else start + (end - start) * step / steps


def _close(got: tuple[float, float], want: tuple[float, float]) -> bool:
    return all(math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-18) for g, w in zip(got, want, strict=True))


def _merged(tables: list[dict[str, list[float]]]) -> dict[str, Any]:
    """The ranks' tables as one (with the distributed optimizer each rank holds the main params of its shard); a
    parameter two ranks disagree about is kept as both values, which matches no expectation."""
    out: dict[str, Any] = {}
    for table in tables:
        for name, value in table.items():
            if out.setdefault(name, tuple(value)) != tuple(value):
                out[name] = (out[name], tuple(value))
    return out


def _mismatches(table: dict[str, Any], want: dict[str, tuple[float, float]]) -> list[str]:
    bad = [f"{n}: (lr, wd) = {table.get(n, 'not in the optimizer')}, expected {want[n]}"
           for n in sorted(want) if n not in table or len(table[n]) != 2 or not isinstance(table[n][0], float)
           or not _close(table[n], want[n])]
    return bad + [f"{n}: in the optimizer but not a model parameter" for n in sorted(set(table) - set(want))]


@pytest.mark.mcore
@pytest.mark.parametrize("case", list(S.CASES))
def test_effective_lr_and_weight_decay_after_the_build(results: list[dict[str, Any]], case: str) -> None:
    got = results[0]["groups"][case]
    want = {}
    for name, shape in got["shapes"].items():
        max_lr, _, mult, wd_mult = _rules(case, name, shape)
        want[name] = (max_lr * mult, S.WD * wd_mult)
    bad = _mismatches(_merged([r["groups"][case]["built"] for r in results]), want)
    assert not bad, "\n".join(bad)


@pytest.mark.mcore
@pytest.mark.parametrize("case", list(S.CASES))
def test_effective_lr_and_weight_decay_under_the_scheduler(results: list[dict[str, Any]], case: str) -> None:
    got = results[0]["groups"][case]
    for step in range(len(got["scheduled"])):
        want = {}
        for name, shape in got["shapes"].items():
            max_lr, min_lr, mult, wd_mult = _rules(case, name, shape)
            want[name] = (_scheduled_lr(step, max_lr, min_lr) * mult, _scheduled_wd(step) * wd_mult)
        bad = _mismatches(_merged([r["groups"][case]["scheduled"][step] for r in results]), want)
        assert not bad, f"step {step}:\n" + "\n".join(bad)


@pytest.mark.mcore
def test_the_cases_cover_every_rule(results: list[dict[str, Any]]) -> None:
    """The inputs exercise what they claim: decoupled, scaled, no-decay 1-D, decaying 1-D and embedding params."""
    shapes = results[0]["groups"]["conds"]["shapes"]
    assert results[0]["groups"]["conds"]["embedding_or_output"], "no embedding/output parameter in the model"
    kinds = {(*_rules("conds", n, s)[2:], _rules("conds", n, s)[0]) for n, s in shapes.items()}
    assert {k[0] for k in kinds} == {1.0, S.LR_MULT} and {k[1] for k in kinds} == {0.0, 1.0}
    assert {k[2] for k in kinds} == {S.LR, S.DECOUPLED_LR}
    default = {_rules("defaults", n, s)[3] for n, s in shapes.items() if len(s) == 1 and not n.endswith(".bias")}
    assert default == {0.0} and {_rules("conds", n, s)[3] for n, s in shapes.items()
                                 if len(s) == 1 and not n.endswith(".bias")} == {1.0}


@pytest.mark.mcore
def test_the_scheduler_is_megatrons_where_the_release_has_one(results: list[dict[str, Any]]) -> None:
    """Megatron's class (a subclass of it that only replaces ``load_state_dict``) where the release has one."""
    names = results[0]["groups"]["defaults"]["scheduler"]
    if has("megatron_scheduler"):
        assert names == ["mcore_compat.training.scheduler.OptimizerParamScheduler",
                         "megatron.core.optimizer_param_scheduler.OptimizerParamScheduler"]
    else:
        assert names[0] == "mcore_compat.training.scheduler.ParamScheduler"


def _decay_failures(result: dict[str, Any]) -> list[str]:
    """What a decay-only step got wrong: no-decay params must be unchanged, the others decayed exactly."""
    bad = []
    for name, shape in result["shapes"].items():
        no_wd = name.endswith(".bias") or len(shape) == 1
        if no_wd and not result["unchanged"][name]:
            bad.append(f"{name} (no weight decay) changed by up to {result['max_rel_change'][name]:.3g} relative")
        if not no_wd and not result["decayed_exactly"][name]:
            bad.append(f"{name} is not p * (1 - lr * wd) (changed {result['max_rel_change'][name]:.3g} relative)")
    return bad


@pytest.mark.mcore
@pytest.mark.parametrize("case", ["decay", "decay-distopt"])
def test_a_decay_only_step_shrinks_weights_by_lr_times_wd_and_nothing_else(results: list[dict[str, Any]],
                                                                           case: str) -> None:
    for rank in results:
        got = rank["decay"][case]
        assert got["update_successful"]
        assert not _decay_failures(got), "\n".join(_decay_failures(got))
        decaying = [n for n, s in got["shapes"].items() if not (n.endswith(".bias") or len(s) == 1)]
        assert decaying and all(not got["unchanged"][n] for n in decaying), "lr * wd too small to see in fp32"


@pytest.mark.mcore
def test_the_decay_check_catches_decaying_biases_and_norms(results: list[dict[str, Any]]) -> None:
    for rank in results:
        failures = _decay_failures(rank["decay"]["fault-no-multipliers"])
        assert failures and all("(no weight decay) changed" in f for f in failures), failures


@pytest.mark.mcore
@pytest.mark.parametrize("style", list(S.STYLES))
def test_our_scheduler_computes_what_megatrons_computes(results: list[dict[str, Any]], style: str) -> None:
    got = results[0]["schedules"][style]
    if "megatron" not in got:
        pytest.skip(f"megatron-core {results[0]['version']} has no OptimizerParamScheduler (0.9+) to compare with")
    ours, theirs = got["ours"], got["megatron"]
    assert [len(row) for row in ours] == [len(row) for row in theirs]
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a == pytest.approx(b, rel=1e-12, abs=0.0), f"step {step}: ours {a}, Megatron's {b}"


@pytest.mark.unit
def test_our_scheduler_refuses_what_megatron_asserts_in_one_line() -> None:
    from mcore_compat.errors import InvalidArgumentError
    from mcore_compat.training.scheduler import ParamScheduler

    with pytest.raises(InvalidArgumentError, match=r"lr_decay_style 'cosinus'.*; need 0 <= start_wd <= end_wd"):
        ParamScheduler(S._Groups(), **{**S.SCHEDULE, "lr_decay_style": "cosinus", "start_wd": 0.5})


@pytest.mark.unit
def test_our_scheduler_applies_lr_mult_and_wd_mult_and_restores_its_state() -> None:
    from mcore_compat.training.scheduler import ParamScheduler

    opt = S._Groups()
    opt.param_groups[0]["lr_mult"] = 0.5
    sched = ParamScheduler(opt, **{**S.SCHEDULE, "lr_decay_style": "linear"})
    sched.step(2)  # end of warmup: the groups' own max_lr, times lr_mult
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [
        (pytest.approx(S.LR * 0.5), pytest.approx(0.05 + (S.WD - 0.05) * 2 / 6)), (pytest.approx(S.DECOUPLED_LR), 0.0)]
    again = ParamScheduler(S._Groups(), **{**S.SCHEDULE, "lr_decay_style": "linear"})
    again.load_state_dict(sched.state_dict())
    assert again.num_steps == 2 and again.state_dict() == sched.state_dict()


@pytest.mark.unit
def test_our_scheduler_warms_every_group_up_from_init_lr_to_its_scaled_peak() -> None:
    """0.16's meaning (the scale lives in the group's peak): a scaled group starts at init_lr, not at
    init_lr * lr_mult as 0.9-0.15's scheduler does; after the warmup the whole schedule is scaled."""
    from mcore_compat.training.scheduler import ParamScheduler

    opt = S._Groups()
    opt.param_groups[0]["lr_mult"] = 2.0
    peak = opt.param_groups[0]["max_lr"] * 2.0
    init = S.LR / 10
    sched = ParamScheduler(opt, **{**S.SCHEDULE, "init_lr": init, "lr_decay_style": "linear"})
    assert opt.param_groups[0]["lr"] == pytest.approx(init)
    sched.step(1)
    assert opt.param_groups[0]["lr"] == pytest.approx(init + (peak - init) / 2)
    sched.step(1)
    assert opt.param_groups[0]["lr"] == pytest.approx(peak)
    assert opt.param_groups[1]["lr"] == pytest.approx(S.DECOUPLED_LR)  # lr_mult 1: Megatron's formula unchanged


@pytest.mark.unit
def test_optimizer_settings_are_refused_in_one_line_naming_each_bad_value() -> None:
    from mcore_compat import training
    from mcore_compat.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError) as info:
        training.check_optimizer_config({"lr": "1e-5", "min_lr": -1.0, "adam_beta2": 1.0, "fp16": True,
                                         "bf16": True, "hysteresis": 0})
    message = str(info.value)
    assert "\n" not in message
    for part in ("lr must be a finite number (got '1e-5')", "need 0.0 <= min_lr", "adam_beta2 < 1.0",
                 "fp16 and bf16 are both set", "hysteresis must be an integer > 0"):
        assert part in message, message


@pytest.mark.unit
def test_optimizer_settings_users_train_with_pass_unchanged() -> None:
    from mcore_compat import training

    config = training.OptimConfig(lr=1e-6, min_lr=1e-7, decoupled_lr=1e-5, decoupled_min_lr=0.0, weight_decay=0.1,
                                  bf16=True, clip_grad=0.0, adam_beta2=0.95, use_distributed_optimizer=True)
    assert training.check_optimizer_config(config) == config
    # fp16 with a static scale ignores the dynamic scaler's fields; lr left to the scheduler is fine
    training.check_optimizer_config({"fp16": True, "loss_scale": 128.0, "hysteresis": 0, "lr": None})
