"""What every parameter trains with: :func:`effective_lr_and_weight_decay`.

Reads the optimizer's main params and their param groups (``mcore_compat._util.optimizer_view``: Megatron's
FP32, Float16 and Distributed optimizers, ``ChainedOptimizer``, mcore_compat's 0.4/0.5 optimizer) and names each
by the model parameter it stands for, so the learning rate and weight decay can be compared per parameter across
releases, precisions and the distributed optimizer.
"""

from __future__ import annotations

from typing import Any

from .._util.optimizer_view import optimizer_view
from ..errors import UnsupportedFeatureError
from ._common import as_chunk_list

__all__ = ["effective_lr_and_weight_decay"]


def _unwrapped(chunk: Any) -> Any:
    while hasattr(chunk, "module") and type(chunk).__name__ in ("DistributedDataParallel", "Float16Module"):
        chunk = chunk.module
    return chunk


def effective_lr_and_weight_decay(optimizer: Any, model_chunks: Any) -> dict[str, tuple[float, float]]:
    """The ``(lr, weight_decay)`` the next optimizer step applies to each trainable parameter.

    Args:
        optimizer: from :func:`~mcore_compat.training.get_megatron_optimizer`.
        model_chunks: the (DDP-wrapped) chunks the optimizer was built for (a single module is accepted).

    Returns:
        ``{name: (lr, weight_decay)}``; ``name`` is the parameter's qualified name inside its chunk (without the
        DDP / Float16Module wrappers), prefixed with ``"<chunk index>."`` when there are several chunks.

    Raises:
        UnsupportedFeatureError: an optimizer whose main params cannot be read (precision-aware, CPU-offloading),
            or parameters held by more than one group with different values.
    """
    chunks, _ = as_chunk_list(model_chunks)
    names: dict[Any, str] = {}
    for i, chunk in enumerate(chunks):
        for name, param in _unwrapped(chunk).named_parameters():
            if param.requires_grad:
                names[param] = name if len(chunks) == 1 else f"{i}.{name}"
    view = optimizer_view(optimizer, names)
    if view.unsupported is not None:
        raise UnsupportedFeatureError(f"effective_lr_and_weight_decay: cannot read {view.unsupported}")
    out: dict[str, tuple[float, float]] = {}
    for mp in view:
        if mp.group is None:
            continue
        value = (float(mp.group["lr"]), float(mp.group["weight_decay"]))
        if out.setdefault(mp.name, value) != value:
            raise UnsupportedFeatureError(f"effective_lr_and_weight_decay: {mp.name} is in groups with different "
                                          f"settings {out[mp.name]} and {value}")
    return out
