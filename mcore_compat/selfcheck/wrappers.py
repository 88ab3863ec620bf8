"""The module under Megatron's wrappers: what the schedule gets as a model chunk is DDP around ``Float16Module``
around the user's module (each optional, on every release); the checks read and copy the module inside."""

from __future__ import annotations

from typing import Any

__all__ = ["core_module", "unwrap_ddp"]


def unwrap_ddp(chunk: Any) -> Any:
    """The module inside Megatron's ``DistributedDataParallel`` (any release); wrappers below it stay."""
    while type(chunk).__name__ == "DistributedDataParallel" and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def core_module(module: Any) -> Any:
    """Strip DDP and ``Float16Module`` wrappers."""
    while type(module).__name__ in ("DistributedDataParallel", "Float16Module") and hasattr(module, "module"):
        module = module.module
    return module
