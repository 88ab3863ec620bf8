"""The optimizer's own rule, recomputed independently in float64, and the rounding bound it is held to.

Given what a main param was before the step (value, Adam/SGD state), the gradient the step read (the finalized
gradient, unscaled and clipped) and the hyper-parameters of its param group, :func:`expected_step` gives the
exact result of the rule; :func:`update_bound` the largest difference an fp32 evaluation of the same rule can
have from it. Derivation (``u = 2**-24``, the unit roundoff of fp32; ``d`` = the update term of the rule):

* The gradient the rule reads is ``fl(fl(c)*g)`` (the clip coefficient rounded to fp32, then the product):
  ``<= 2u`` relative to the exact clipped gradient.
* Adam/AdamW: ``p' = p*(1 - lr*wd) - d`` with ``d = s * m'/(sqrt(v')/sqrt(bc2) + eps)``, ``s = lr/bc1``
  (decoupled decay; with L2 decay ``g + wd*p`` enters the moments instead).
  ``m' = b1*m + (1-b1)*g`` (a lerp: three roundings, plus the gradient's ``2u``) errs by ``<= 5u*M`` with
  ``M = b1|m| + (1-b1)|g|`` the sum of its terms' magnitudes (no cancellation bound: ``M`` may exceed
  ``|m'|``); ``v' = b2*v + (1-b2)*g*g`` (non-negative terms) by ``<= 8u*v'`` (the squared gradient ``4u+u``,
  the constant, the two products and the sum). In ``d``: the square root halves ``v'``'s error (``4u``), then
  the sqrt, the bias-correction constant and division, the eps add, the step-size constant and the
  multiply-divide add ``<= 8u``: ``<= 12u|d|``, plus ``m'``'s error carried as ``<= 5u*D`` with
  ``D = s*M/(sqrt(v')/sqrt(bc2) + eps)``. The decay factor and product add ``<= 2u|p|``, the final subtraction
  ``<= u|p'|``. Bound: ``|p'_fp32 - p'| <= u*(2|p| + |p'| + 12|d| + 6D)``; moments: ``6u*M`` and ``10u*v'``
  (one ``u`` of margin each for second-order terms).
* SGD (momentum ``mu``, L2 decay): ``d = lr*(g + wd*p)`` or with momentum ``lr*buf'``; bound
  ``u*(2|p| + |p'| + 6(|d| + D))`` with ``D`` the same sum over the terms' magnitudes; momentum buffer
  ``<= 6u`` times its terms' magnitudes.

No element may exceed its bound (no outlier allowance); an element whose exact update exceeds its bound then
necessarily moved in the rule's direction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["BOUND_TEXT", "Rule", "expected_step", "rule_of", "unsupported_group"]

U32 = 2.0**-24
BOUND_TEXT = {
    "adam": "per element |p' - p'_rule| <= 2^-24*(2|p| + |p'| + 12|d| + 6D) (fp32 rounding of Adam's operations; "
            "d = the update, D = the update of the moments' term magnitudes)",
    "sgd": "per element |p' - p'_rule| <= 2^-24*(2|p| + |p'| + 6(|d| + D)) (fp32 rounding of SGD's operations)",
}


@dataclass(frozen=True)
class Rule:
    """The update rule of a torch optimizer: ``kind`` ``"adam"`` or ``"sgd"``; ``decoupled`` weight decay."""

    kind: str
    decoupled: bool


def rule_of(inner: Any) -> Rule | str:
    """The rule of a torch optimizer instance, or why it is not known (a string)."""
    import torch

    if isinstance(inner, torch.optim.AdamW):
        return Rule("adam", True)
    if isinstance(inner, torch.optim.Adam):
        return Rule("adam", bool(inner.defaults.get("decoupled_weight_decay", False)))
    if isinstance(inner, torch.optim.SGD):
        return Rule("sgd", False)
    name = type(inner).__name__
    if name == "FusedAdam" and hasattr(inner, "adam_w_mode"):  # apex / TransformerEngine FusedAdam
        return Rule("adam", bool(inner.adam_w_mode))
    return f"{type(inner).__module__}.{name}"


def _hyper(group: dict[str, Any], rule: Rule) -> dict[str, Any]:
    h = {"lr": float(group["lr"]), "wd": float(group.get("weight_decay", 0.0))}
    if rule.kind == "adam":
        b1, b2 = group.get("betas", (0.9, 0.999))
        h.update(b1=float(b1), b2=float(b2), eps=float(group.get("eps", 1e-8)),
                 amsgrad=bool(group.get("amsgrad", False)), maximize=bool(group.get("maximize", False)),
                 bias_correction=bool(group.get("bias_correction", True)))
    else:
        h.update(momentum=float(group.get("momentum", 0.0)), dampening=float(group.get("dampening", 0.0)),
                 nesterov=bool(group.get("nesterov", False)), maximize=bool(group.get("maximize", False)))
    return h


def unsupported_group(group: dict[str, Any], rule: Rule) -> str | None:
    """A setting of ``group`` the oracle does not model (``None`` if all are modelled)."""
    h = _hyper(group, rule)
    if h.get("amsgrad"):
        return "amsgrad"
    if h.get("maximize"):
        return "maximize"
    return None


def expected_step(rule: Rule, group: dict[str, Any], p0: Any, grad: Any, state0: dict[str, Any]
                  ) -> tuple[Any, dict[str, Any], Any]:
    """The rule applied exactly (float64) to ``p0``, the gradient and the state before the step.

    ``state0`` holds the torch optimizer's state before the step (empty before the first one). Returns
    ``(p', state', bound)``: the state with torch's keys (``exp_avg``, ``exp_avg_sq``, ``step``;
    ``momentum_buffer``) and, per element, the bound of the module docstring for ``p'`` (``state'`` also gets a
    ``"<key>.bound"`` entry per moment).
    """
    import torch

    h = _hyper(group, rule)
    p = p0.double()
    g = grad.double()
    if rule.kind == "adam":
        t = int(float(state0["step"])) + 1 if "step" in state0 else 1
        m = state0["exp_avg"].double() if "exp_avg" in state0 else torch.zeros_like(p)
        v = state0["exp_avg_sq"].double() if "exp_avg_sq" in state0 else torch.zeros_like(p)
        if h["wd"] and not rule.decoupled:
            g = g + h["wd"] * p
        m1 = h["b1"] * m + (1.0 - h["b1"]) * g
        m_abs = h["b1"] * m.abs() + (1.0 - h["b1"]) * g.abs()
        v1 = h["b2"] * v + (1.0 - h["b2"]) * g * g
        bc1 = 1.0 - h["b1"] ** t if h["bias_correction"] else 1.0
        bc2 = 1.0 - h["b2"] ** t if h["bias_correction"] else 1.0
        denom = v1.sqrt() / math.sqrt(bc2) + h["eps"]
        d = (h["lr"] / bc1) * m1 / denom
        d_abs = (h["lr"] / bc1) * m_abs / denom
        p1 = (p * (1.0 - h["lr"] * h["wd"]) if (h["wd"] and rule.decoupled) else p) - d
        bound = U32 * (2.0 * p.abs() + p1.abs() + 12.0 * d.abs() + 6.0 * d_abs)
        return p1, {"exp_avg": m1, "exp_avg_sq": v1, "step": t, "exp_avg.bound": 6.0 * U32 * m_abs,
                    "exp_avg_sq.bound": 10.0 * U32 * v1}, bound
    d = g + h["wd"] * p if h["wd"] else g
    d_abs = g.abs() + h["wd"] * p.abs() if h["wd"] else g.abs()
    state: dict[str, Any] = {}
    if h["momentum"]:
        buf = state0.get("momentum_buffer")
        if buf is None:
            buf1, buf_abs = d.clone(), d_abs.clone()
        else:
            buf1 = h["momentum"] * buf.double() + (1.0 - h["dampening"]) * d
            buf_abs = h["momentum"] * buf.double().abs() + (1.0 - h["dampening"]) * d_abs
        state = {"momentum_buffer": buf1, "momentum_buffer.bound": 6.0 * U32 * buf_abs}
        if h["nesterov"]:
            d, d_abs = d + h["momentum"] * buf1, d_abs + h["momentum"] * buf_abs
        else:
            d, d_abs = buf1, buf_abs
    p1 = p - h["lr"] * d
    bound = U32 * (2.0 * p.abs() + p1.abs() + 6.0 * h["lr"] * (d.abs() + d_abs))
    return p1, state, bound
