"""The spec oracle of the generated settings tests: what a learning-rate / weight-decay schedule and one optimizer
step must give, written in plain Python (float64) from the published formulas, sharing no code with
``mcore_compat`` or Megatron.

* Learning rate (Megatron-LM's ``OptimizerParamScheduler``, as documented: linear warmup from ``init_lr`` to the
  group's peak over ``lr_warmup_steps``; after ``lr_decay_steps`` the group's floor; in between the decay style:
  ``linear``, ``cosine`` (half a cosine period, Loshchilov & Hutter's SGDR without restarts),
  ``inverse-square-root`` (peak * sqrt(warmup / step), never under the floor), ``WSD`` (warmup-stable-decay: the
  peak until the last ``wsd_decay_steps`` of the decay, then ``linear``, ``cosine``, ``exponential``
  (2 * 0.5^r - 1) or ``minus_sqrt`` (1 - sqrt(r)) down to the floor), ``constant`` (the peak after warmup).
* Weight decay: ``start_wd`` to ``end_wd`` over ``wd_incr_steps`` (``constant``, ``linear``, or ``cosine``: a
  half cosine rising from 0 to 1), ``end_wd`` after; a no-decay parameter gets 0.
* A group's peak and floor: its own (``OptimConfig.lr``/``min_lr``; ``decoupled_lr``/``decoupled_min_lr`` for
  embedding and output weights, the floor falling back to ``min_lr``), else the scheduler's; a parameter of
  ``scale_lr_cond`` has both times ``lr_mult``.
* Adam (``torch.optim.Adam``'s published algorithm, Kingma & Ba with bias correction): decoupled weight decay
  (AdamW, Loshchilov & Hutter) multiplies the parameter by ``1 - lr * wd`` before the update; coupled decay adds
  ``wd * param`` to the gradient before the moments. Gradient clipping scales every gradient by
  ``clip / (norm + 1e-6)`` when that is below 1 (the global L2 norm over all parameters, Megatron's
  ``clip_grad_norm_fp32``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

LR_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class Schedule:
    """The scheduler's arguments (``optimizer_param_scheduler``'s names)."""

    init_lr: float
    max_lr: float
    min_lr: float
    lr_warmup_steps: int
    lr_decay_steps: int
    lr_decay_style: str
    start_wd: float
    end_wd: float
    wd_incr_steps: int
    wd_incr_style: str
    wsd_decay_steps: int | None = None
    lr_wsd_decay_style: str | None = None

    def kwargs(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _anneal(style: str, progress: float) -> float:
    """The fraction of (peak - floor) left after ``progress`` (0..1) of an annealing phase."""
    if style == "linear":
        return 1.0 - progress
    if style == "cosine":
        return (1.0 + math.cos(math.pi * progress)) / 2.0
    if style == "exponential":
        return 2.0 * 0.5 ** progress - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(progress)
    raise ValueError(style)


def lr_at(step: int, s: Schedule, peak: float, floor: float) -> float:
    """The learning rate at ``step`` of a group whose peak and floor are ``peak`` and ``floor``."""
    warm = s.lr_warmup_steps
    if warm > 0 and step <= warm:
        return s.init_lr + (peak - s.init_lr) * (step / warm)
    if s.lr_decay_style == "constant":
        return peak
    if step > s.lr_decay_steps:
        return floor
    if s.lr_decay_style == "inverse-square-root":
        return max(floor, peak * math.sqrt(max(warm, 1) / max(step, 1)))
    if s.lr_decay_style == "WSD":
        assert s.wsd_decay_steps is not None and s.lr_wsd_decay_style is not None
        stable_until = s.lr_decay_steps - s.wsd_decay_steps
        if step <= stable_until:
            return peak
        return floor + _anneal(s.lr_wsd_decay_style, (step - stable_until) / s.wsd_decay_steps) * (peak - floor)
    progress = (step - warm) / (s.lr_decay_steps - warm)
    return floor + _anneal(s.lr_decay_style, progress) * (peak - floor)


def wd_at(step: int, s: Schedule) -> float:
    """The scheduled weight decay at ``step`` (before a group's no-decay rule)."""
    if step > s.wd_incr_steps or s.wd_incr_style == "constant":
        return s.end_wd
    progress = step / s.wd_incr_steps
    rise = progress if s.wd_incr_style == "linear" else (1.0 - math.cos(math.pi * progress)) / 2.0
    return s.start_wd + rise * (s.end_wd - s.start_wd)


@dataclass(frozen=True)
class GroupRule:
    """How one parameter is grouped: decoupled (embedding/output weight with a decoupled lr), scaled
    (``scale_lr_cond``), no weight decay."""

    decoupled: bool
    scaled: bool
    no_decay: bool


def bounds(rule: GroupRule, *, lr: float | None, min_lr: float | None, decoupled_lr: float | None,
           decoupled_min_lr: float | None, lr_mult: float, s: Schedule) -> tuple[float, float]:
    """``(peak, floor)`` of a parameter: its group's own, else the scheduler's; times ``lr_mult`` when scaled."""
    if rule.decoupled and decoupled_lr is not None:
        peak: float | None = decoupled_lr
        floor = decoupled_min_lr if decoupled_min_lr is not None else min_lr
    else:
        peak, floor = lr, min_lr
    peak = s.max_lr if peak is None else peak
    floor = s.min_lr if floor is None else floor
    mult = lr_mult if rule.scaled else 1.0
    return peak * mult, floor * mult


def trajectory(rule: GroupRule, steps: int, s: Schedule, **config: float | None) -> list[tuple[float, float]]:
    """``[(lr, weight decay)]`` of a parameter at steps ``0 .. steps``."""
    peak, floor = bounds(rule, s=s, **config)  # type: ignore[arg-type]
    return [(lr_at(n, s, peak, floor), 0.0 if rule.no_decay else wd_at(n, s)) for n in range(steps + 1)]


# ------------------------------------------------------------------------------------------------------ optimizer
@dataclass(frozen=True)
class Adam:
    """One Adam optimizer's settings."""

    beta1: float
    beta2: float
    eps: float
    decoupled: bool
    clip_grad: float


def clip_coeff(grads: Mapping[str, Sequence[float]], clip_grad: float) -> float:
    """The factor every gradient is scaled by (1 when no clipping applies)."""
    if clip_grad <= 0:
        return 1.0
    norm = math.sqrt(sum(g * g for gs in grads.values() for g in gs))
    coeff = clip_grad / (norm + 1e-6)
    return coeff if coeff < 1.0 else 1.0


def adam_steps(params: Mapping[str, Sequence[float]], grads: Sequence[Mapping[str, Sequence[float]]],
               hyper: Sequence[Mapping[str, tuple[float, float]]], adam: Adam) -> dict[str, list[float]]:
    """The parameters after ``len(grads)`` Adam steps, in float64.

    Args:
        params: name -> flat values before the first step.
        grads: per step, name -> flat gradient (already data-parallel averaged).
        hyper: per step, name -> (lr, weight decay) of that step.
        adam: the optimizer.
    """
    p = {n: [float(x) for x in v] for n, v in params.items()}
    m = {n: [0.0] * len(v) for n, v in p.items()}
    v2 = {n: [0.0] * len(v) for n, v in p.items()}
    for t, (step_grads, step_hyper) in enumerate(zip(grads, hyper, strict=True), start=1):
        coeff = clip_coeff(step_grads, adam.clip_grad)
        for name, values in p.items():
            lr, wd = step_hyper[name]
            g = [coeff * float(x) for x in step_grads[name]]
            if not adam.decoupled:
                g = [gi + wd * pi for gi, pi in zip(g, values, strict=True)]
            mm, vv = m[name], v2[name]
            for i, gi in enumerate(g):
                mm[i] = adam.beta1 * mm[i] + (1.0 - adam.beta1) * gi
                vv[i] = adam.beta2 * vv[i] + (1.0 - adam.beta2) * gi * gi
            c1, c2 = 1.0 - adam.beta1 ** t, 1.0 - adam.beta2 ** t
            new = []
            for i, pi in enumerate(values):
                if adam.decoupled:
                    pi = pi * (1.0 - lr * wd)
                new.append(pi - lr * (mm[i] / c1) / (math.sqrt(vv[i] / c2) + adam.eps))
            p[name] = new
    return p
