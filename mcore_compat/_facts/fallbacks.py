"""Our own implementations of surface symbols for the releases that lack them (the symbol table points here)."""

from __future__ import annotations

from typing import Any

__all__ = ["unwrap_model"]


def _default_wrappers() -> tuple[type, ...]:
    import importlib

    found: list[type] = []
    for module, name in (("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel"),
                         ("megatron.core.transformer.module", "Float16Module"),
                         ("torch.nn.parallel", "DistributedDataParallel")):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def unwrap_model(model: Any, module_instances: tuple[type, ...] | None = None) -> Any:
    """Strip wrapper modules (Megatron DDP, Float16Module, torch DDP) from a model or a list of model chunks.

    Same contract as ``megatron.core.utils.unwrap_model`` (0.14+): returns a list for a list, else one module.
    """
    wrappers = module_instances or _default_wrappers()
    chunks = model if isinstance(model, list) else [model]
    out = []
    for chunk in chunks:
        while isinstance(chunk, wrappers):
            wrapper: Any = chunk  # isinstance over a tuple of types narrows to object
            chunk = wrapper.module
        out.append(chunk)
    return out if isinstance(model, list) else out[0]
