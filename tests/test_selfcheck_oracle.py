"""The update oracle against torch's own Adam/AdamW (no Megatron): a correct fp32 step stays within the rounding
bound for coupled (L2 through the moments) and decoupled weight decay, also where the decayed gradient cancels;
a step with the groups changed inside it (maximize, swapped betas, decay on the no-decay params) does not; and
the hyper-parameters come from the configuration, not from the groups."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mcore_compat.selfcheck.configured import Configured, from_optimizer
from mcore_compat.selfcheck.oracle import Rule, expected_step

WD, LR = 0.1, 1e-2


def _configured(decoupled: bool, lr: float = LR) -> Configured:
    return Configured(Rule("adam", decoupled), (0.9, 0.999), 1e-8, 0.9, lr, WD, lambda n, p: p.dim() == 1, "test")


def _params(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(4096, generator=g)
    grad = torch.randn(4096, generator=g) * 0.05
    # a quarter of the elements: the gradient cancels the L2 term (g + wd*p ~ 0 up to fp32 rounding)
    grad[:1024] = -WD * p[:1024] * (1.0 + 1e-7 * torch.randn(1024, generator=g))
    return p, grad


def _worst(decoupled: bool, lr: float, corrupt: str = "") -> float:
    """Two torch steps (the groups changed inside the step by ``corrupt``); the worst error/bound of the oracle
    over params and moments."""
    p, grad = _params(3)
    param = torch.nn.Parameter(p.clone())
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([param], lr=lr, weight_decay=WD, betas=(0.9, 0.999), eps=1e-8, foreach=False)
    conf = _configured(decoupled, lr)
    worst = 0.0
    for step in range(2):
        p0 = param.detach().clone()
        state0 = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[param].items()}
        g = grad * (1.0 + 0.5 * step)
        param.grad = g.clone()
        group = opt.param_groups[0]
        if corrupt == "maximize":
            group["maximize"] = True
        elif corrupt == "betas":
            group["betas"] = (0.999, 0.9)
        opt.step()
        h = conf.hyper("w", torch.zeros(2, 2), {"lr": lr, "weight_decay": WD}, True)
        p1, state1, bound = expected_step(conf.rule, h, p0, g.double(), state0)
        err = (param.detach().double() - p1).abs()
        worst = max(worst, float((err / bound).max()))
        for key in ("exp_avg", "exp_avg_sq"):
            e = (opt.state[param][key].double() - state1[key]).abs()
            worst = max(worst, float((e / state1[f"{key}.bound"].clamp_min(1e-300)).max()))
    return worst


@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("lr", [1e-6, 1e-2])
def test_a_correct_step_is_within_the_bound(decoupled: bool, lr: float) -> None:
    assert _worst(decoupled, lr) <= 1.0


@pytest.mark.parametrize("corrupt", ["maximize", "betas"])
@pytest.mark.parametrize("decoupled", [False, True])
def test_groups_changed_inside_the_step_are_off_the_rule(decoupled: bool, corrupt: str) -> None:
    assert _worst(decoupled, LR, corrupt) > 100.0


def test_the_wrong_decay_mode_is_off_the_rule() -> None:
    """An optimizer built coupled where the configuration says decoupled: the update is off the rule."""
    p, grad = _params(5)
    param = torch.nn.Parameter(p.clone())
    opt = torch.optim.Adam([param], lr=LR, weight_decay=WD, foreach=False)
    param.grad = grad.clone()
    opt.step()
    conf = _configured(True)
    h = conf.hyper("w", torch.zeros(2, 2), {"lr": LR, "weight_decay": WD}, True)
    p1, _, bound = expected_step(conf.rule, h, p.clone(), grad.double(), {})
    assert int(((param.detach().double() - p1).abs() > bound).sum()) > 1000


def test_hyper_parameters_come_from_the_configuration() -> None:
    conf = _configured(False)
    group_now: dict[str, Any] = {"lr": 5.0, "weight_decay": 3.0, "betas": (0.5, 0.5), "eps": 1.0, "maximize": True}
    h = conf.hyper("0.layer.weight", torch.zeros(2, 2), group_now, True)
    assert h == {"lr": LR, "wd": WD, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "bias_correction": True}
    assert conf.hyper("0.norm.weight", torch.zeros(2), group_now, True)["wd"] == 0.0


def test_from_optimizer_reads_the_optimizers_config() -> None:
    """check_training_step's source: the Megatron optimizer's config (decoupled_weight_decay, betas, eps), the
    group's lr and weight decay before the step, none on a group that had wd_mult 0 at the start."""
    inner = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    config = SimpleNamespace(optimizer="adam", decoupled_weight_decay=False, adam_beta1=0.8, adam_beta2=0.99,
                             adam_eps=1e-6, sgd_momentum=0.9, clip_grad=1.0)
    confs = from_optimizer(SimpleNamespace(config=config, optimizer=inner))
    conf = confs[id(inner)]
    assert isinstance(conf, Configured) and conf.rule == Rule("adam", False)
    before = {"lr": 2e-3, "weight_decay": 0.05}
    assert conf.hyper("w", torch.zeros(2, 2), before, True) == {
        "lr": 2e-3, "wd": 0.05, "b1": 0.8, "b2": 0.99, "eps": 1e-6, "bias_correction": True}
    assert conf.hyper("b", torch.zeros(2), before, False)["wd"] == 0.0
    assert conf.hyper("w", torch.zeros(2, 2), before, True, eps_built=1e-5)["eps"] == 1e-5  # config_overrides
    # before 0.15 the field is absent: Megatron's Adam is AdamW
    del config.decoupled_weight_decay
    assert from_optimizer(SimpleNamespace(config=config, optimizer=inner))[0].rule == Rule("adam", True)  # type: ignore[union-attr]
