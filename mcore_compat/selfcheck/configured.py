"""The hyper-parameters each main param's update must follow, taken from the configuration the optimizer was
built from, not from the torch optimizer's param groups at step time.

A bug inside the step can change the groups (``maximize`` switched on, betas swapped, weight decay put on the
no-decay group); an oracle that read them back would recompute the bug and agree with it. So the rule
(Adam or SGD, weight decay decoupled or through the moments), betas, eps, momentum and weight decay come from the
configuration: the self-check's own :class:`~mcore_compat.training.OptimConfig` and Megatron-LM's no-decay rule
(:func:`from_options`), or, for :func:`~mcore_compat.selfcheck.check_training_step` on the caller's optimizer,
the ``OptimizerConfig`` (or ``OptimConfig``) each optimizer carries and the ``wd_mult`` its param groups had when
the verifier was built, before any step (:func:`from_optimizer`). ``maximize`` is never configured: Megatron
builds every optimizer minimizing.

The learning rate may legitimately come from a scheduler. The self-check runs a constant schedule
(``set_lr_and_weight_decay`` at its configured ``lr``), so it takes ``lr`` from its options. The caller's
optimizer may have a scheduler that sets each group's ``lr`` (and ``weight_decay``) before the step; there they are
the group's values snapshotted before the step starts, so a change made inside the step is still caught. The
check's detail says where each value came from (:attr:`Configured.sources`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .oracle import Rule

__all__ = ["Configured", "from_optimizer", "from_options"]


def _get(config: Any, name: str, default: Any) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    value = getattr(config, name, default)
    return default if value is None else value


@dataclass(frozen=True)
class Configured:
    """What one torch optimizer's updates must follow.

    Attributes:
        rule: Adam or SGD, decoupled weight decay or not.
        betas, eps: Adam's; ``momentum``: SGD's.
        lr: the learning rate of every param, or ``None``: its group's value before the step (a scheduler's).
        weight_decay: the decayed params' weight decay, or ``None``: the group's value before the step.
        no_decay: ``(name, param) -> bool``, the params that get no weight decay; ``None``: those whose group had
            ``wd_mult == 0`` (or weight decay 0) when the verifier was built.
        sources: where each hyper-parameter came from, for the check's detail.
    """

    rule: Rule
    betas: tuple[float, float]
    eps: float
    momentum: float
    lr: float | None
    weight_decay: float | None
    no_decay: Callable[[str, Any], bool] | None
    sources: str

    def hyper(self, name: str, model_param: Any, group_before: dict[str, Any], decays: bool,
              eps_built: float | None = None) -> dict[str, Any]:
        """The oracle's hyper-parameters for one main param (``decays``: its group decayed at build time;
        ``eps_built``: its group's eps then, which a 0.19+ ``config_overrides`` entry (MuP) may set per group;
        honoured only where the configuration is the optimizer's, :func:`from_optimizer`)."""
        lr = self.lr if self.lr is not None else float(group_before["lr"])
        no_wd = self.no_decay(name, model_param) if self.no_decay is not None else not decays
        wd = 0.0 if no_wd else (self.weight_decay if self.weight_decay is not None
                                else float(group_before.get("weight_decay", 0.0)))
        if self.rule.kind == "adam":
            eps = eps_built if eps_built is not None and self.no_decay is None else self.eps
            return {"lr": lr, "wd": wd, "b1": self.betas[0], "b2": self.betas[1], "eps": eps,
                    "bias_correction": True}
        return {"lr": lr, "wd": wd, "momentum": self.momentum, "dampening": 0.0, "nesterov": False}


def _rule(config: Any) -> Rule | str:
    kind = str(_get(config, "optimizer", "adam")).lower()
    if kind not in ("adam", "sgd"):
        return f"optimizer {kind!r}"
    # before 0.15 OptimizerConfig has no decoupled_weight_decay: Megatron's Adam is AdamW (and mcore_compat's
    # optimizer for 0.4/0.5 is torch AdamW)
    return Rule(kind, kind == "adam" and bool(_get(config, "decoupled_weight_decay", True)))


def from_options(opts: Any, no_decay: Callable[[str, Any], bool]) -> Configured:
    """The self-check's configuration: its ``OptimConfig`` (:func:`~.models.optim_config`), learning rate
    ``opts.lr`` (0 for the ``lr_zero`` fault, which builds with it), ``no_decay`` for the biases and norms."""
    from .models import optim_config

    config = optim_config(opts)
    rule = _rule(config)
    assert isinstance(rule, Rule)
    lr = 0.0 if opts.fault == "lr_zero" else float(opts.lr)
    return Configured(rule, (float(config.adam_beta1), float(config.adam_beta2)), float(config.adam_eps),
                      float(config.sgd_momentum), lr, float(config.weight_decay), no_decay,
                      f"lr {lr:g}, weight decay {config.weight_decay:g} "
                      f"({'decoupled' if rule.decoupled else 'L2 through the moments'}; none on biases and norms), "
                      f"betas ({config.adam_beta1:g}, {config.adam_beta2:g}), eps {config.adam_eps:g}, clipping "
                      f"{config.clip_grad:g}, no maximize: from the self-check's OptimConfig")


def _configs(optimizer: Any) -> list[tuple[Any, Any]]:
    """``(config, torch optimizer)`` of ``optimizer`` and each chained one."""
    out = []
    for opt in (optimizer, *getattr(optimizer, "chained_optimizers", ())):
        config = getattr(opt, "config", None)
        if config is not None:
            out.append((config, _inner(opt)))
    return out


def _inner(opt: Any) -> Any:
    """The torch optimizer ``opt`` wraps (``None`` for a chain of several: 0.16+'s ``ChainedOptimizer.optimizer``
    asserts there is one, optimizer/optimizer.py)."""
    if len(getattr(opt, "chained_optimizers", ()) or ()) > 1:
        return None
    return getattr(opt, "optimizer", None)


def from_optimizer(optimizer: Any) -> dict[int, Configured | str]:
    """Per torch optimizer (by ``id``; key ``0``: the fallback) the configuration of the Megatron (or
    mcore_compat) optimizer wrapping it, or why it is unknown (a string)."""
    out: dict[int, Configured | str] = {}
    for config, inner in _configs(optimizer):
        rule = _rule(config)
        if isinstance(rule, str):
            entry: Configured | str = rule
        else:
            b1, b2 = float(_get(config, "adam_beta1", 0.9)), float(_get(config, "adam_beta2", 0.999))
            eps = float(_get(config, "adam_eps", 1e-8))
            entry = Configured(rule, (b1, b2), eps, float(_get(config, "sgd_momentum", 0.9)), None, None, None,
                               f"weight decay {'decoupled' if rule.decoupled else 'L2 through the moments'}, "
                               f"betas ({b1:g}, {b2:g}), eps {eps:g}, clipping {_get(config, 'clip_grad', 0.0):g}, "
                               f"no maximize: from the optimizer's config (eps: the group's at the start where "
                               f"config_overrides set it); lr and weight decay: each group's "
                               f"before the step (the scheduler's), none where the group had wd_mult 0 at the "
                               f"start")
        if inner is not None:
            out.setdefault(id(inner), entry)
        out.setdefault(0, entry)
    return out
