"""One optimizer step, and new learning rate / weight decay, on every release.

:func:`optimizer_step` hides 0.4/0.5's ``step(args, timers)``; :func:`set_lr_and_weight_decay` sets every group's
effective values as ``get_megatron_optimizer`` does at build time.
"""

from __future__ import annotations

import inspect
from typing import Any

from ._common import installed_version
from .optim_groups import _apply_lr_and_weight_decay

__all__ = ["optimizer_step", "set_lr_and_weight_decay"]


class _NullTimers:
    """Stand-in for Megatron-LM's ``Timers`` for optimizers whose ``step`` wants one (0.4/0.5 tree)."""

    def __call__(self, *args: Any, **kwargs: Any) -> _NullTimers:
        return self

    def start(self, *args: Any, **kwargs: Any) -> None:
        return None

    def stop(self, *args: Any, **kwargs: Any) -> None:
        return None


_STEP_TAKES_ARGS_TIMERS: dict[type, bool] = {}


def _wants_args_timers(optimizer: Any) -> bool:
    """Whether ``optimizer.step`` is Megatron-LM 0.4/0.5's ``step(args, timers)`` (cached per class)."""
    cls = type(optimizer)
    if cls not in _STEP_TAKES_ARGS_TIMERS:
        required = [p.name for p in inspect.signature(optimizer.step).parameters.values()
                    if p.default is inspect.Parameter.empty
                    and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        _STEP_TAKES_ARGS_TIMERS[cls] = required == ["args", "timers"]
    return _STEP_TAKES_ARGS_TIMERS[cls]


def optimizer_step(optimizer: Any) -> tuple[bool, float | None, int | None]:
    """Run one optimizer step and return ``(update_successful, grad_norm, num_zeros_in_grad)``.

    Hides ``step(args, timers)`` (Megatron-LM 0.4/0.5 tree optimizers) vs ``step()`` (0.6+ and
    mcore_compat's legacy optimizer). The grad norm is a Python float (or ``None`` when the release does not
    compute it, e.g. ``clip_grad == 0`` on 0.6-0.11).
    """
    if _wants_args_timers(optimizer):
        result = optimizer.step(None, _NullTimers())
    else:
        result = optimizer.step()
    if not isinstance(result, tuple):
        result = (bool(result), None, None)
    ok, norm, zeros = (*result, None, None, None)[:3]
    if norm is not None and hasattr(norm, "item"):
        norm = norm.item()
    if zeros is not None and hasattr(zeros, "item"):
        zeros = zeros.item()
    return bool(ok), (None if norm is None else float(norm)), zeros


def _base_lr(optimizer: Any) -> float | None:
    """The configured (undecoupled, unscaled) learning rate the optimizer was built with."""
    for opt in (optimizer, *getattr(optimizer, "chained_optimizers", ())):
        config = getattr(opt, "config", None)
        lr = config.get("lr") if isinstance(config, dict) else getattr(config, "lr", None)
        if lr is not None:
            return float(lr)
    return None


def set_lr_and_weight_decay(optimizer: Any, lr: float, weight_decay: float) -> None:
    """Set every param group's effective learning rate and weight decay, as a constant schedule would.

    What ``get_megatron_optimizer`` does at build time, for new values: a group gets ``lr`` times its ratio to
    the configured learning rate (decoupled-lr groups, and ``scale_lr_cond`` groups on 0.16+, keep theirs)
    times its ``lr_mult`` where the release's scheduler applies it, and ``weight_decay * wd_mult``. The same
    effective (lr, weight decay) per parameter on every release.
    """
    _apply_lr_and_weight_decay(optimizer, lr, weight_decay, _base_lr(optimizer), installed_version())
