"""Rank body for tests/test_independent_reference.py: self-check runs of the tiny GPT (and the MLP) with a fault
placed INSIDE Megatron's layer code, where :class:`~mcore_compat.selfcheck.reference.PlainReference` (a copy of
the same modules) cannot see it, and clean runs of the same configurations. Each fault is undone after its run
(the ranks serve the whole test session)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _no_tp_reduction() -> Callable[[], None]:
    """``reduce_from_tensor_model_parallel_region`` as ``megatron.core.tensor_parallel.layers`` looks it up
    becomes the identity: RowParallelLinear's and VocabParallelEmbedding's outputs stay partial sums (TP > 1,
    no sequence parallelism)."""
    import importlib

    layers = importlib.import_module("megatron.core.tensor_parallel.layers")
    real = layers.reduce_from_tensor_model_parallel_region
    layers.reduce_from_tensor_model_parallel_region = lambda input_, *args, **kwargs: input_
    return lambda: setattr(layers, "reduce_from_tensor_model_parallel_region", real)


def _stale_column_weight() -> Callable[[], None]:
    """ColumnParallelLinear's forward computes with the values its weight had at its first call, while the
    gradients flow into the real weight (what a layer that caches a converted copy of its weight does)."""
    import importlib

    cls = importlib.import_module("megatron.core.tensor_parallel.layers").ColumnParallelLinear
    real = cls.forward

    def forward(self: Any, input_: Any, weight: Any = None, *args: Any, **kwargs: Any) -> Any:
        if weight is None and self.weight is not None:
            snapshot = self.__dict__.setdefault("_stale_snapshot", self.weight.detach().clone())
            weight = self.weight + (snapshot - self.weight).detach()  # the old values, the real weight's gradient
        return real(self, input_, weight, *args, **kwargs)

    cls.forward = forward
    return lambda: setattr(cls, "forward", real)


def _rolled_weight_grad_rows() -> Callable[[], None]:
    """The weight gradient Megatron's linear autograd function returns has its rows rolled by one (every
    Column/RowParallelLinear, tensor_parallel/layers.py ``LinearWithGradAccumulationAndAsyncCommunication``)."""
    import importlib

    fn = importlib.import_module("megatron.core.tensor_parallel.layers").LinearWithGradAccumulationAndAsyncCommunication
    real = fn.__dict__["backward"]

    def backward(ctx: Any, *grads: Any) -> Any:
        out = list(real.__func__(ctx, *grads))
        if out[1] is not None:
            out[1] = out[1].roll(1, 0)
        return tuple(out)

    fn.backward = staticmethod(backward)
    return lambda: setattr(fn, "backward", real)


FAULTS: dict[str, Callable[[], Callable[[], None]]] = {
    "no_tp_reduction": _no_tp_reduction,
    "stale_column_weight": _stale_column_weight,
    "rolled_weight_grad_rows": _rolled_weight_grad_rows,
}


def run_case(fault: str | None, options: Any) -> dict[str, Any]:
    """One self-check configuration (``options`` resolved for this group) on this rank, with ``fault`` in place
    for its duration; returns this rank's checks (or the traceback)."""
    from mcore_compat import patches

    patches.apply_for_device("cpu")
    from mcore_compat.selfcheck.runner import _spawned_sweep

    undo = FAULTS[fault]() if fault else None
    try:
        results, _noise = _spawned_sweep([options])
    finally:
        if undo is not None:
            undo()
    checks, _env, error = results[0]
    return {"checks": checks, "error": error}


def run_cases(cases: dict[str, tuple[str | None, Any]]) -> dict[str, dict[str, Any]]:
    """Every ``name: (fault, options)`` of ``cases``, one after another, on this rank."""
    return {name: run_case(fault, options) for name, (fault, options) in cases.items()}
