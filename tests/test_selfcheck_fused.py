"""The per-element functions of the step checks (selfcheck.elements) and how they run (selfcheck.fused)."""

from __future__ import annotations

import pytest
import torch

from mcore_compat.selfcheck import elements, fused
from mcore_compat.selfcheck.oracle import Rule, expected_step

HYPER = {"lr": 1e-3, "wd": 0.1, "b1": 0.9, "b2": 0.95, "eps": 1e-8, "bias_correction": True}


def _step(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A state before and after one correct fp32 AdamW step (torch's own, as the optimizer would run it)."""
    g = torch.Generator().manual_seed(seed)
    p0, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    m0, v0 = torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.01
    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([p], lr=HYPER["lr"], betas=(HYPER["b1"], HYPER["b2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["wd"], foreach=False)
    opt.state[p] = {"step": torch.tensor(3.0), "exp_avg": m0.clone(), "exp_avg_sq": v0.clone()}
    p.grad = grad.clone()
    opt.step()
    return {"p0": p0, "grad": grad, "m0": m0, "v0": v0, "p1": p.detach().clone(), "m1": opt.state[p]["exp_avg"],
            "v1": opt.state[p]["exp_avg_sq"]}


def _update(s: dict[str, torch.Tensor], seg: torch.Tensor | None = None, n: int = 1) -> tuple:
    return elements.update_block(Rule("adam", True), HYPER, s["p0"], s["grad"], 1.0,
                                 {"step": 3, "exp_avg": s["m0"], "exp_avg_sq": s["v0"]}, s["p1"],
                                 {"exp_avg": s["m1"], "exp_avg_sq": s["v1"]}, seg, n, 1)


def test_a_correct_step_is_within_its_bounds_and_a_planted_deviation_is_counted() -> None:
    s = _step(5_000)
    worst, over, moment_over, changed, sample = _update(s)
    assert float(changed) == 5_000 and float(worst) <= 1.0 and float(over) == 0 and all(float(o) == 0 for o in moment_over.values())
    assert sample.numel() == 5_000 and bool((sample > 0).all())
    s["p1"][17] += 1e-4 * s["p1"][17].abs() + 1e-6  # off the rule in one element
    s["m1"][99] *= 0.5  # one moment off
    worst, over, moment_over, _, _ = _update(s)
    assert float(worst) > 1.0 and float(over) == 1
    assert float(moment_over["exp_avg"]) == 1 and float(moment_over["exp_avg_sq"]) == 0


def test_segments_give_each_param_its_own_verdict() -> None:
    """Small params concatenated into one block (``seg``): the counts land on the param that deviated."""
    s = _step(3_000, seed=1)
    s["p1"][2_500] = s["p1"][2_500] + 1.0
    seg = torch.repeat_interleave(torch.arange(3), torch.tensor([1_000, 1_000, 1_000]))
    worst, over, _, _, _ = _update(s, seg, 3)
    assert over.tolist() == [0.0, 0.0, 1.0] and worst[2] > 1.0 >= float(worst[:2].max())


def test_the_block_uses_the_oracle_unchanged() -> None:
    """The per-element function and the documented oracle agree (the same expression, not a copy of it)."""
    s = _step(100, seed=2)
    p1, _state1, bound = expected_step(Rule("adam", True), HYPER, s["p0"], s["grad"].double(),
                                       {"step": 3, "exp_avg": s["m0"], "exp_avg_sq": s["v0"]})
    *_, sample = _update(s)
    assert torch.equal(sample, bound / p1.abs())


def test_gradient_block_counts_elements_over_their_bound() -> None:
    want = torch.randn(1_000)
    bound = want.abs() * 1e-6
    got = want.clone()
    got[5] += 1e-3
    worst, over, sample = elements.grad_block(got, want, bound, None, 1, 10)
    assert float(over) == 1 and float(worst) > 1 and sample.numel() == 100


def _clipped(grad: torch.Tensor, c: float, inv_scale: float = 1.0) -> torch.Tensor:
    """What Megatron's step hands the inner optimizer: the fp32 gradient unscaled (in place), then times the clip
    coefficient (``_foreach_mul_`` / ``multi_tensor_scale``: fp32 products)."""
    return grad.float().mul(inv_scale).mul(c)


@pytest.mark.parametrize(("c", "inv_scale"), [(0.123456789, 1.0), (1.0, 1.0), (0.37, 0.125), (0.9999999, 1 / 3)])
def test_the_median_ratio_is_the_factor_applied(c: float, inv_scale: float) -> None:
    grad = torch.randn(100_000, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    used = _clipped(grad, c, inv_scale)
    fitted = float(elements.scale_sample(grad, used, 7).nanmedian().float())  # rounded to fp32, as verify does
    applied = float(torch.tensor(c * inv_scale, dtype=torch.float32)) if inv_scale in (1.0, 0.125) else c * inv_scale
    assert abs(fitted - applied) <= 2 * 2.0**-24 * applied
    # a minority of corrupted elements does not move it; no ratio where the gradient is zero
    used[:1000] *= 3.0
    assert float(elements.scale_sample(grad, used, 7).nanmedian().float()) == fitted
    assert torch.isnan(elements.scale_sample(torch.zeros(4), torch.zeros(4), 1)).all()


def test_runs_eagerly_on_the_cpu() -> None:
    assert not fused.enabled(torch.device("cpu"))
    assert fused.block_elements(torch.device("cpu")) == fused.EAGER_BLOCK


def test_a_compiler_failure_falls_back_once_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where compiling fails the same function runs eagerly (the same verdicts), with one warning saying so."""
    monkeypatch.setattr(fused, "_FAILED", [])
    monkeypatch.setattr(fused, "_COMPILED", {})
    monkeypatch.setattr(fused, "enabled", lambda device: not fused._FAILED)

    def broken(fn: object, **kw: object) -> object:
        def call(*a: object, **k: object) -> object:
            raise RuntimeError("no compiler here\nmore lines")
        return call

    monkeypatch.setattr(torch, "compile", broken)
    with pytest.warns(RuntimeWarning, match="could not be compiled .RuntimeError: no compiler here.; it runs op by op"):
        assert fused.run(lambda x: x + 1, "cuda", 2) == 3
    assert fused.run(lambda x: x + 1, "cuda", 4) == 5  # no second warning: compiling is off for the process
