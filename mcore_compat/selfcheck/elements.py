"""What each element of a block contributes to the gradient and update checks: pure tensor functions.

Each function takes one block (a slice of one param, or small params concatenated, ``seg`` giving each element's
segment: its param) and returns per segment the worst ``err / bound`` (> 1: an element over its bound; ``inf``:
a nonzero error with a zero bound) and the number of elements over their bound, as float64 device vectors, plus
``bound / |value|`` of a systematic sample (every ``stride``-th element) for the resolution the report states.
They hold no state and read no Megatron object, so :func:`.fused.run` can compile them into fused kernels.
"""

from __future__ import annotations

from typing import Any

from .oracle import Rule, expected_step

__all__ = ["grad_block", "scale_sample", "update_block"]

#: the oracle without its CPU-harness wrapper (``own_tensor_math`` is applied by the caller's method)
_RULE = getattr(expected_step, "__wrapped__", expected_step)

_CANONICAL: dict[Rule, Rule] = {}


def canonical(rule: Rule) -> Rule:
    """One instance per distinct rule (a compiled :func:`update_block` is keyed by the objects it is given:
    a new but equal instance per step would compile it again)."""
    return _CANONICAL.setdefault(rule, rule)


def _ratio(err: Any, bound: Any) -> Any:
    import torch

    return torch.where(bound > 0, err / bound.clamp_min(torch.finfo(bound.dtype).tiny),
                       torch.where(err > 0, float("inf"), 0.0))


def _worst(r: Any, seg: Any, n: int) -> Any:
    import torch

    if seg is None:
        return r.max().double().reshape(1)
    return torch.zeros(n, dtype=torch.float64, device=r.device).scatter_reduce_(0, seg, r.double(), "amax")


def _count(over: Any, seg: Any, n: int) -> Any:
    import torch

    if seg is None:
        return over.sum().double().reshape(1)
    return torch.zeros(n, dtype=torch.float64, device=over.device).index_add_(0, seg, over.double())


def grad_block(got: Any, want: Any, bound: Any, seg: Any, n: int, stride: int) -> tuple[Any, Any, Any]:
    """The finalized gradient ``got`` against the reference ``want`` within ``bound`` (compared in fp32):
    ``(worst, over, sample)``."""
    g, w, b = got.float(), want.float(), bound.float()
    err = (g - w).abs()
    return _worst(_ratio(err, b), seg, n), _count(err > b, seg, n), b[::stride] / w[::stride].abs()


def update_block(rule: Rule, hyper: dict[str, Any], p0: Any, grad: Any, scale: Any, state0: dict[str, Any],
                 got: Any, moments_now: dict[str, Any], seg: Any, n: int, stride: int,
                 present: dict[str, bool] | None = None) -> tuple[Any, Any, dict[str, Any], Any, Any]:
    """The rule (:func:`.oracle.expected_step`, float64) on the block's value ``p0``, gradient ``grad * scale``
    (unscaled and clipped) and state ``state0``, against the main param ``got`` and the moments ``moments_now``
    after the step: ``(worst, over, {moment: over}, changed, sample)``; ``worst`` covers the moments too,
    ``changed`` counts the elements whose main param the step changed. ``hyper``, ``scale`` and
    ``state0["step"]`` may be 0-d device tensors (:func:`device_scalars`; ``present``: :func:`.oracle.branches`
    of their values), so that a compiled block is not specialized to the learning rate or step count."""
    import torch

    p1, state1, bound = _RULE(rule, hyper, p0, grad.double() * scale, state0, present)
    err = (got.double() - p1).abs()
    r = _ratio(err, bound)
    moment_over: dict[str, Any] = {}
    for key, now in moments_now.items():
        if key not in state1:
            continue
        e, b = (now.double() - state1[key]).abs(), state1[f"{key}.bound"]
        r = torch.maximum(r, _ratio(e, b))
        moment_over[key] = _count(e > b, seg, n)
    return (_worst(r, seg, n), _count(err > bound, seg, n), moment_over, _count(got != p0, seg, n),
            bound[::stride] / p1[::stride].abs())


def scale_sample(grad: Any, used: Any, stride: int) -> Any:
    """``used / grad`` of every ``stride``-th element (float64; NaN where the gradient is zero): the factor the
    optimizer's gradients carry is their median (robust to a minority of corrupted elements; the update check,
    run on ``grad`` times it, then sees every element)."""
    import torch

    g, u = grad[::stride].double(), used[::stride].double()
    return torch.where(g != 0, u / torch.where(g != 0, g, 1.0), float("nan"))


def device_scalars(values: dict[str, Any], device: Any) -> dict[str, Any]:
    """The numbers among ``values`` as 0-d float64 tensors on ``device`` (one copy to the device for all);
    booleans and anything else stay as they are."""
    import torch

    keys = [k for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if not keys:
        return dict(values)
    # non-blocking: a blocking copy from host memory waits for the device's queue to drain (a host sync per call)
    packed = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64).to(device, non_blocking=True)
    out = dict(values)
    out.update({k: packed[i] for i, k in enumerate(keys)})
    return out
