"""What Megatron-Core built: the buffer layout read from DDP-wrapped model chunks.

Megatron's ``DistributedDataParallel`` (``megatron/core/distributed/distributed_data_parallel.py``) keeps its
buffers in ``grad_buffers`` (a dict by grad dtype, 0.4/0.5) or ``buffers`` and ``expert_parallel_buffers``
(0.6+); each buffer's ``param_index_map`` says where each param lives.
"""

from __future__ import annotations

from typing import Any, Final

import torch
from packaging.version import Version

from .facts import layout_fact
from .model import BucketLayout, BufferKey, BufferLayout, LayoutError, ModelLayout, ParamLayout
from .version import resolve_version

__all__ = ["ddp_buffers", "layout_of", "unwrap"]

#: Wrapper classes stripped to find the module whose parameter names the user sees.
_WRAPPER_CLASS_NAMES: Final = frozenset({
    "DistributedDataParallel", "Float16Module", "FullyShardedDataParallel", "TorchFullyShardedDataParallel",
})


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The module whose parameter names the user sees: ``module`` with DDP, ``Float16Module`` and FSDP wrappers
    (their ``.module``) stripped.

    Args:
        module: a model chunk, wrapped or not.

    Returns:
        The innermost module that is not one of those wrappers (``module`` itself when it is none).
    """
    while type(module).__name__ in _WRAPPER_CLASS_NAMES:
        inner = getattr(module, "module", None)
        if not isinstance(inner, torch.nn.Module):
            break
        module = inner
    return module


def ddp_buffers(chunk: Any, version: Version | str) -> list[tuple[Any, bool]]:
    """``(buffer, is_expert)`` of one DDP-wrapped chunk, in Megatron's order: dense buffers, then expert buffers.

    Args:
        chunk: a model chunk wrapped in Megatron-Core's ``DistributedDataParallel``.
        version: the megatron-core release that built it.

    Returns:
        Megatron's buffer objects (``GradBuffer``/``ParamAndGradBuffer``/``_ParamAndGradBuffer``), each with
        whether it holds expert params.

    Raises:
        LayoutError: ``chunk`` has no DDP buffer attribute (not wrapped in Megatron-Core's DDP).
    """
    dense_attr, expert_attr = layout_fact("ddp_buffer_attrs", version)
    if not hasattr(chunk, dense_attr):
        raise LayoutError(
            f"{type(chunk).__name__} has no attribute {dense_attr!r}: layout_of needs the model chunks wrapped "
            f"in Megatron-Core's DistributedDataParallel (megatron-core {version})"
        )
    dense = getattr(chunk, dense_attr)
    dense = list(dense.values()) if isinstance(dense, dict) else list(dense)
    expert = list(getattr(chunk, expert_attr)) if expert_attr else []
    return [(b, False) for b in dense] + [(b, True) for b in expert]


def _buffer_key(buffer: Any, chunk: int, is_expert: bool, version: Version) -> BufferKey:
    grouping = layout_fact("buffer_grouping", version)
    if grouping == "grad_dtype":
        return BufferKey(chunk, None, buffer.dtype, is_expert)
    layer_wise = False
    if grouping == "buffer_key" and buffer.param_index_map:
        first = next(iter(buffer.param_index_map))
        layer_wise = bool(getattr(first, "is_managed_by_layer_wise_optimizer", False))
    return BufferKey(chunk, buffer.param_dtype, buffer.grad_dtype, is_expert, layer_wise)


def _read_buffer(buffer: Any, key: BufferKey, order: dict[torch.Tensor, tuple[int, str]],
                 version: Version) -> BufferLayout:
    has_unpadded = layout_fact("bucket_numel_unpadded", version)
    buckets = tuple(
        BucketLayout(i, int(s), int(e), int(buffer.buckets[i].numel_unpadded) if has_unpadded else None)
        for i, (s, e) in enumerate(buffer.bucket_indices)
    )
    params = []
    for param, (start, end, bucket) in buffer.param_index_map.items():
        if param not in order:
            raise LayoutError(f"a {tuple(param.shape)} param of buffer {key} is not among the chunk's parameters")
        params.append((int(start), -order[param][0],
                       ParamLayout(order[param][1], int(start), int(end), int(bucket), tuple(param.shape))))
    params.sort(key=lambda t: (t[0], t[1]))
    has_param_data = (layout_fact("param_data_with_distopt", version)
                      and getattr(buffer, "param_data", None) is not None)
    return BufferLayout(
        key=key,
        dp_size=int(buffer.data_parallel_world_size),
        numel=int(buffer.numel),
        numel_unpadded=int(buffer.numel_unpadded) if layout_fact("buffer_numel_unpadded", version) else None,
        buckets=buckets,
        params=tuple(p for _, _, p in params),
        has_param_data=bool(has_param_data),
    )


def layout_of(model_chunks: Any, *, version: Version | str | None = None) -> ModelLayout:
    """What Megatron-Core built: the buffers of DDP-wrapped model chunks.

    Args:
        model_chunks: one Megatron ``DistributedDataParallel`` or a list of them (one per virtual pipeline
            chunk). Parameter names are those of the innermost module (wrappers such as DDP and
            ``Float16Module`` stripped).
        version: the megatron-core release that built them (default: the installed one).

    Returns:
        The layout, buffer by buffer (per chunk: dense buffers, then expert buffers, in Megatron's order).

    Raises:
        LayoutError: a chunk is not Megatron-DDP-wrapped, or holds params it does not expose.
    """
    v = resolve_version(version)
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    buffers: list[BufferLayout] = []
    unbuffered: list[tuple[int, str]] = []
    for index, chunk in enumerate(chunks):
        order: dict[torch.Tensor, tuple[int, str]] = {}
        for position, (name, param) in enumerate(unwrap(chunk).named_parameters()):
            order[param] = (position, name)
        held: set[torch.Tensor] = set()
        for buffer, is_expert in ddp_buffers(chunk, v):
            key = _buffer_key(buffer, index, is_expert, v)
            buffers.append(_read_buffer(buffer, key, order, v))
            held.update(buffer.param_index_map)
        unbuffered.extend((index, name) for param, (_, name) in order.items()
                          if param.requires_grad and param not in held)
    return ModelLayout(tuple(buffers), tuple(unbuffered), str(v))
