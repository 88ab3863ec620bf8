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
* Adam with L2 decay (``decoupled=False``): the decayed gradient ``g + wd*p`` errs by ``<= 3u*(|g| + wd|p|)``
  (clip, product, sum), relative to the terms' magnitudes, not to the sum (which may cancel); ``M`` uses
  ``|g| + wd|p|``, ``m'`` is held to ``7u*M``, ``v'`` to ``11u*V`` with ``V = b2*v + (1-b2)(|g| + wd|p|)^2``,
  and ``d`` to ``u*(12|d| + 7D_lo) + s|m'|(1/den_lo - 1/den)`` with ``den_lo`` the denominator at
  ``v' - 11u*V`` (clamped at 0) and ``D_lo = s*M/den_lo``.
* SGD (momentum ``mu``, L2 decay): ``d = lr*(g + wd*p)`` or with momentum ``lr*buf'``; bound
  ``u*(2|p| + |p'| + 6(|d| + D))`` with ``D`` the same sum over the terms' magnitudes; momentum buffer
  ``<= 6u`` times its terms' magnitudes.

No element may exceed its bound (no outlier allowance); an element whose exact update exceeds its bound then
necessarily moved in the rule's direction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._util.deprecated import warn_deprecated_name
from .._util.own_math import own_tensor_math

__all__ = ["BOUND_TEXT", "Rule", "expected_step", "rule_of"]

U32 = 2.0**-24
BOUND_TEXT = {
    "adam": "per element |p' - p'_rule| <= 2^-24*(2|p| + |p'| + 12|d| + 6D) (fp32 rounding of Adam's operations; "
            "d = the update, D = the update of the moments' term magnitudes)",
    "adam-l2": "per element |p' - p'_rule| <= 2^-24*(2|p| + |p'| + 12|d| + 7D_lo) + s|m'|(1/den_lo - 1/den) (fp32 "
               "rounding of Adam with L2 decay: the decayed gradient g + wd*p bounded by its terms' magnitudes, "
               "the denominator at its smallest)",
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


def branches(rule: Rule, h: dict[str, Any]) -> dict[str, bool]:
    """Which terms of the rule are present (decided from the hyper-parameters' values, before any tensor
    math): ``decay`` (weight decay is nonzero), ``momentum`` and ``nesterov`` (SGD)."""
    return {"decay": bool(h["wd"]), "momentum": bool(h.get("momentum", 0.0)), "nesterov": bool(h.get("nesterov"))}


@own_tensor_math
def expected_step(rule: Rule, h: dict[str, Any], p0: Any, grad: Any, state0: dict[str, Any],
                  present: dict[str, bool] | None = None) -> tuple[Any, dict[str, Any], Any]:
    """The rule applied exactly (float64) to ``p0``, the gradient and the state before the step.

    ``h``: the hyper-parameters (``lr``, ``wd``; Adam: ``b1``, ``b2``, ``eps``, ``bias_correction``; SGD:
    ``momentum``, ``dampening``, ``nesterov``), as configured (:mod:`.configured`), never ``maximize``.
    ``state0`` holds the torch optimizer's state before the step (empty before the first one). Returns
    ``(p', state', bound)``: the state with torch's keys (``exp_avg``, ``exp_avg_sq``, ``step``;
    ``momentum_buffer``) and, per element, the bound of the module docstring for ``p'`` (``state'`` also gets a
    ``"<key>.bound"`` entry per moment).

    The hyper-parameters and ``state0["step"]`` may be Python numbers or 0-d float64 tensors on the params'
    device (then the rule reads no value on the host and a compiled evaluation is not specialized to them);
    ``present`` (:func:`branches` of the values) says which terms the rule has.
    """
    import torch

    if present is None:
        present = branches(rule, h)
    p = p0.double()
    g = grad.double()
    if rule.kind == "adam":
        step0 = state0.get("step")
        t = (step0.double() + 1 if _is_tensor(step0) else int(float(step0)) + 1) if step0 is not None else 1
        m = state0["exp_avg"].double() if "exp_avg" in state0 else torch.zeros_like(p)
        v = state0["exp_avg_sq"].double() if "exp_avg_sq" in state0 else torch.zeros_like(p)
        coupled = present["decay"] and not rule.decoupled
        g_abs = g.abs() + h["wd"] * p.abs() if coupled else g.abs()
        if coupled:
            g = g + h["wd"] * p
        m1 = h["b1"] * m + (1.0 - h["b1"]) * g
        m_abs = h["b1"] * m.abs() + (1.0 - h["b1"]) * g_abs
        v1 = h["b2"] * v + (1.0 - h["b2"]) * g * g
        bc1 = 1.0 - h["b1"] ** t if h["bias_correction"] else 1.0
        bc2 = 1.0 - h["b2"] ** t if h["bias_correction"] else 1.0
        s = h["lr"] / bc1
        denom = v1.sqrt() / bc2 ** 0.5 + h["eps"]
        d = s * m1 / denom
        p1 = (p * (1.0 - h["lr"] * h["wd"]) if (present["decay"] and rule.decoupled) else p) - d
        if not coupled:
            d_abs = s * m_abs / denom
            bound = U32 * (2.0 * p.abs() + p1.abs() + 12.0 * d.abs() + 6.0 * d_abs)
            return p1, {"exp_avg": m1, "exp_avg_sq": v1, "step": t, "exp_avg.bound": 6.0 * U32 * m_abs,
                        "exp_avg_sq.bound": 10.0 * U32 * v1}, bound
        # L2 decay: the gradient read carries <= 3u*(|g| + wd|p|) (clip, product, sum), which cancellation in
        # g + wd*p can make large relative to the sum; the squared moment is bounded by its terms' magnitudes V
        # and d by the smallest denominator v' - 11u*V allows (an element whose decayed gradient cancels may move
        # either way, by at most its bound)
        v_terms = h["b2"] * v + (1.0 - h["b2"]) * g_abs * g_abs
        v_err = 11.0 * U32 * v_terms
        denom_lo = (v1 - v_err).clamp_min(0.0).sqrt() / bc2 ** 0.5 + h["eps"]
        d_lo = s * m_abs / denom_lo
        bound = (U32 * (2.0 * p.abs() + p1.abs() + 12.0 * d.abs() + 7.0 * d_lo)
                 + s * m1.abs() * (1.0 / denom_lo - 1.0 / denom))
        return p1, {"exp_avg": m1, "exp_avg_sq": v1, "step": t, "exp_avg.bound": 7.0 * U32 * m_abs,
                    "exp_avg_sq.bound": v_err}, bound
    d = g + h["wd"] * p if present["decay"] else g
    d_abs = g.abs() + h["wd"] * p.abs() if present["decay"] else g.abs()
    state: dict[str, Any] = {}
    if present["momentum"]:
        buf = state0.get("momentum_buffer")
        if buf is None:
            buf1, buf_abs = d.clone(), d_abs.clone()
        else:
            buf1 = h["momentum"] * buf.double() + (1.0 - h["dampening"]) * d
            buf_abs = h["momentum"] * buf.double().abs() + (1.0 - h["dampening"]) * d_abs
        state = {"momentum_buffer": buf1, "momentum_buffer.bound": 6.0 * U32 * buf_abs}
        if present["nesterov"]:
            d, d_abs = d + h["momentum"] * buf1, d_abs + h["momentum"] * buf_abs
        else:
            d, d_abs = buf1, buf_abs
    p1 = p - h["lr"] * d
    bound = U32 * (2.0 * p.abs() + p1.abs() + 6.0 * h["lr"] * (d.abs() + d_abs))
    return p1, state, bound


def _is_tensor(v: Any) -> bool:
    return hasattr(v, "dim") and hasattr(v, "reshape")


def unsupported_group(group: dict[str, Any], rule: Rule) -> str | None:
    """Deprecated (warns once): the setting of a torch param group the oracle does not model, ``"amsgrad"`` or
    ``"maximize"`` (``None`` if it models all); the self-check now reads the rule's settings from the
    configuration (:mod:`.configured`), not from the groups."""
    warn_deprecated_name(f"{__name__}.unsupported_group")
    if rule.kind == "adam" and group.get("amsgrad", False):
        return "amsgrad"
    if group.get("maximize", False):
        return "maximize"
    return None
