"""What a Megatron optimizer really updates: its main params, which model param (and which part) each one
stands for, its param group and its state.

Every Megatron optimizer wraps a torch optimizer (``.optimizer``) whose param groups hold the *main* params,
the tensors the update is computed on. How they relate to the model params is one of five layouts, the same
on every release that has them (0.6 ... 0.19, Megatron-Core ``optimizer/optimizer.py`` and
``optimizer/distrib_optimizer.py``; 0.4/0.5 use ``mcore_compat.legacy_optimizer``):

* ``ChainedOptimizer`` (``chained_optimizers``): several of the below (dense and expert params, or one per
  model chunk on some releases);
* ``DistributedOptimizer``: fp32 shards, ``shard_fp32_from_float16_groups`` / ``shard_fp32_groups`` parallel to
  ``model_float16_groups`` / ``model_fp32_groups``; the part of the model param is
  ``_get_model_param_range_map(param)["param"]`` (a range of the flattened param);
* ``Float16OptimizerWithFloat16Params``: whole fp32 copies, ``fp32_from_float16_groups`` parallel to
  ``float16_groups``; fp32 model params (``fp32_from_fp32_groups``) are their own main params;
* ``FP32Optimizer``: the model params are the main params;
* ``LegacyOptimizer`` (ours, 0.4/0.5): ``_slots`` (model param, main tensor, range).

The layout is recognised by these attributes, not by a version; an optimizer that has none of them (a
precision-aware or CPU-offloading optimizer whose main params are not fp32 tensors with ``.grad``) gives a
view with :attr:`OptimizerView.unsupported` set, and the checks that need it report "not applicable".

It sits below every layer that reads main params (``training/param_groups.py``, ``lifecycle/_collect.py``,
``selfcheck/``) and imports nothing of mcore_compat (``mcore_compat.selfcheck.optimizer_view`` re-exports it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MainParam", "OptimizerView", "optimizer_view"]


@dataclass(eq=False)
class MainParam:
    """One tensor the optimizer updates.

    Attributes:
        main: the main param (fp32; the model param itself for fp32 models without a distributed optimizer).
        model: the model param it stands for.
        start, end: the flattened range of ``model`` that ``main`` covers (``None``: all of it).
        sharded: ``main`` is this rank's shard of a param sharded over the data-parallel group (distributed
            optimizer): other ranks own the rest; otherwise every data-parallel rank holds all of it.
        inner: the torch optimizer that updates ``main`` (its ``state[main]``).
        group: the param group (a dict of the torch optimizer) holding ``main``; ``None`` if in none.
        name: the model param's name (``"<chunk>.<qualified name>"``), filled by the caller.
    """

    main: Any
    model: Any
    start: int | None
    end: int | None
    sharded: bool
    inner: Any
    group: dict[str, Any] | None = None
    name: str = ""

    def model_part(self, tensor: Any) -> Any:
        """The part of ``tensor`` (the model param or a tensor of its shape) that :attr:`main` covers, flat."""
        flat = tensor.reshape(-1)
        return flat if self.start is None else flat[self.start:self.end]

    def finalized_grad(self) -> Any:
        """The gradient the optimizer will read for this main param: the model param's ``main_grad`` (DDP's
        buffer, after ``finalize_model_grads``), else its ``.grad``; ``None`` if it has neither."""
        source = getattr(self.model, "main_grad", None)
        if source is None:
            source = self.model.grad
        return None if source is None else self.model_part(source)


@dataclass
class OptimizerView:
    """The main params of an optimizer (see the module docstring), or why they cannot be read."""

    params: list[MainParam] = field(default_factory=list)
    inner: list[Any] = field(default_factory=list)
    loss_scale_of: Any = None
    unsupported: str | None = None

    def __iter__(self) -> Iterator[MainParam]:
        return iter(self.params)

    def loss_scale(self) -> float:
        """The loss scale the next step will unscale the gradients by (1.0 without a grad scaler)."""
        if self.loss_scale_of is None:
            return 1.0
        value = self.loss_scale_of()
        return float(value.item() if hasattr(value, "item") else value)


def _ranges(opt: Any, model_param: Any) -> tuple[int, int]:
    rng = opt._get_model_param_range_map(model_param)["param"]
    return int(rng.start), int(rng.end)


def _leaf(opt: Any) -> tuple[list[MainParam], str | None]:
    """The main params of one (non-chained) optimizer."""
    inner = getattr(opt, "optimizer", None)
    if hasattr(opt, "_slots"):  # mcore_compat.legacy_optimizer.LegacyOptimizer
        return [MainParam(s.main, s.model_param, s.start, s.end, s.start is not None and not s.replicated, inner)
                for s in opt._slots], None
    if getattr(getattr(opt, "config", None), "use_precision_aware_optimizer", False):
        return [], ("a precision-aware optimizer (its main params and gradients live in `decoupled_grad` and "
                    "reduced-precision state)")
    if inner is None or not hasattr(inner, "param_groups"):
        return [], f"{type(opt).__name__} has no inner torch optimizer"
    out: list[MainParam] = []
    if hasattr(opt, "shard_fp32_from_float16_groups"):  # DistributedOptimizer
        for model_groups, main_groups in ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                                          (opt.model_fp32_groups, opt.shard_fp32_groups)):
            for model_group, main_group in zip(model_groups, main_groups, strict=True):
                for model_param, main in zip(model_group, main_group, strict=True):
                    start, end = _ranges(opt, model_param)
                    out.append(MainParam(main, model_param, start, end, True, inner))
        return out, None
    if hasattr(opt, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
        for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True):
            for model_param, main in zip(model_group, main_group, strict=True):
                out.append(MainParam(main, model_param, None, None, False, inner))
        for group in opt.fp32_from_fp32_groups:
            for param in group:
                out.append(MainParam(param, param, None, None, False, inner))
        return out, None
    if type(opt).__name__ == "FP32Optimizer":
        for group in inner.param_groups:
            for param in group["params"]:
                out.append(MainParam(param, param, None, None, False, inner))
        return out, None
    return [], f"{type(opt).__name__} (main params not recognised)"


def optimizer_view(optimizer: Any, named_params: dict[Any, str] | None = None) -> OptimizerView:
    """Read the main params of ``optimizer`` (any Megatron optimizer, or mcore_compat's legacy one).

    Args:
        optimizer: the optimizer (``ChainedOptimizer`` included).
        named_params: ``{model param: name}`` to fill :attr:`MainParam.name`.
    """
    view = OptimizerView(loss_scale_of=getattr(optimizer, "get_loss_scale", None))
    stack = [optimizer]
    while stack:
        opt = stack.pop(0)
        chained = getattr(opt, "chained_optimizers", None)
        if chained is not None:
            stack[:0] = list(chained)
            continue
        params, why = _leaf(opt)
        if why is not None:
            return OptimizerView(unsupported=why)
        inner = getattr(opt, "optimizer", None)
        if inner is not None and all(inner is not i for i in view.inner):
            view.inner.append(inner)
        view.params.extend(params)
    group_of: dict[int, dict[str, Any]] = {}
    for inner in view.inner:
        for group in inner.param_groups:
            for p in group["params"]:
                group_of[id(p)] = group
    for mp in view.params:
        mp.group = group_of.get(id(mp.main))
        if named_params is not None:
            mp.name = named_params.get(mp.model, "?")
    return view
