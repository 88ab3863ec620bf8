"""The data model of a buffer layout: buffers, buckets and param places, and how two layouts differ.

:class:`ModelLayout` is what :func:`~mcore_compat.layout.layout_of` reads and
:func:`~mcore_compat.layout.compute_layout` computes; :class:`ParamSpec` is what the latter needs to know about one
parameter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Union

import torch

from ..errors import McoreCompatError, NotFoundError

__all__ = [
    "BucketLayout",
    "BufferKey",
    "BufferLayout",
    "LayoutError",
    "ModelLayout",
    "ParamLayout",
    "ParamSpec",
    "ParamsArg",
]


class LayoutError(McoreCompatError, ValueError):
    """A layout cannot be computed or read: bad settings, or settings Megatron itself rejects."""



def _dtype_name(dtype: torch.dtype | None) -> str:
    return "any" if dtype is None else str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class BufferKey:
    """Identity of one buffer: which model chunk it belongs to and which params it groups.

    Attributes:
        chunk: index of the model chunk (position in the list given to :func:`layout_of`).
        param_dtype: storage dtype of the params (``torch.uint8`` for TE float8 params, 0.9+); ``None`` in
            0.4/0.5, whose buffers group params by grad dtype only (params of several dtypes can share one).
        grad_dtype: dtype of the gradient buffer.
        is_expert_parallel: holds expert params (``param.allreduce == False``), reduced over the expert
            data-parallel group.
        is_managed_by_layer_wise_optimizer: 0.18+: params tagged for the layer-wise optimizer get buffers
            of their own (always ``False`` before 0.18).
    """

    chunk: int
    param_dtype: torch.dtype | None
    grad_dtype: torch.dtype
    is_expert_parallel: bool = False
    is_managed_by_layer_wise_optimizer: bool = False

    def __str__(self) -> str:
        kind = "expert" if self.is_expert_parallel else "dense"
        if self.is_managed_by_layer_wise_optimizer:
            kind += "+layerwise"
        return f"chunk{self.chunk}/{_dtype_name(self.param_dtype)}->{_dtype_name(self.grad_dtype)}/{kind}"


@dataclass(frozen=True)
class BucketLayout:
    """One bucket of a buffer: the range ``[start, end)`` that is reduced by one collective.

    Attributes:
        index: bucket index within its buffer (``param_index_map``'s third entry).
        start: first element (inclusive).
        end: last element (exclusive), after padding.
        numel_unpadded: elements up to the end of the last param, as Megatron records it (0.5+; ``None`` in 0.4).
    """

    index: int
    start: int
    end: int
    numel_unpadded: int | None

    @property
    def numel(self) -> int:
        """Elements in the bucket, padding included."""
        return self.end - self.start

    @property
    def padding(self) -> int | None:
        """Elements added at the bucket end (``None`` where Megatron does not record ``numel_unpadded``)."""
        return None if self.numel_unpadded is None else self.numel - self.numel_unpadded


@dataclass(frozen=True)
class ParamLayout:
    """Where one parameter lives in its buffer: ``main_grad`` is ``grad_data[start:end].view(shape)``.

    Attributes:
        name: the parameter's name in the unwrapped module's ``named_parameters()`` (first occurrence for shared
            params).
        start: first element in the buffer.
        end: ``start + numel``.
        bucket: index of the bucket the param belongs to.
        shape: the parameter's shape.
    """

    name: str
    start: int
    end: int
    bucket: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements."""
        return self.end - self.start


@dataclass(frozen=True)
class BufferLayout:
    """One flat buffer and everything in it.

    Attributes:
        key: which buffer (chunk, dtypes, expert, layer-wise).
        dp_size: size of the data-parallel group the buffer is reduced over (the padding divisor's base).
        numel: elements in the buffer, padding included.
        numel_unpadded: Megatron's ``numel_unpadded`` (sum of the buckets' ``numel_unpadded``; 0.7+, else
            ``None``).
        buckets: the buckets in order.
        params: the params in layout order (ascending ``start``; Megatron lays params out in reverse
            registration order).
        has_param_data: the buffer holds a flat ``param_data`` tensor that the params' ``.data`` are views of
            (distributed optimizer, 0.6+).
    """

    key: BufferKey
    dp_size: int
    numel: int
    numel_unpadded: int | None
    buckets: tuple[BucketLayout, ...]
    params: tuple[ParamLayout, ...]
    has_param_data: bool

    @property
    def padding(self) -> int:
        """Elements of the buffer that belong to no parameter (alignment gaps and bucket-end padding)."""
        return self.numel - sum(p.numel for p in self.params)

    def param(self, name: str) -> ParamLayout:
        """The param called ``name``.

        Raises:
            NotFoundError: no such param in this buffer.
        """
        for p in self.params:
            if p.name == name:
                return p
        raise NotFoundError(f"no param {name!r} in buffer {self.key}")

    def bucket_params(self, index: int) -> tuple[ParamLayout, ...]:
        """The params of bucket ``index``, in layout order."""
        return tuple(p for p in self.params if p.bucket == index)


@dataclass(frozen=True)
class ModelLayout:
    """The buffers of all model chunks. Equal layouts compare equal (``version`` is not compared).

    Attributes:
        buffers: per chunk: dense buffers in order of creation, then expert buffers.
        unbuffered: ``(chunk, name)`` of trainable params that are in no buffer (expert params in 0.4/0.5,
            which get a private ``main_grad``).
        version: the megatron-core release the layout is for (informational).
    """

    buffers: tuple[BufferLayout, ...]
    unbuffered: tuple[tuple[int, str], ...] = ()
    version: str = field(default="", compare=False)

    @classmethod
    def combine(cls, *layouts: ModelLayout) -> ModelLayout:
        """Join per-chunk layouts (e.g. from :func:`compute_layout` with ``chunk=0, 1, ...``) into one."""
        versions = {lay.version for lay in layouts if lay.version}
        return cls(
            buffers=tuple(b for lay in layouts for b in lay.buffers),
            unbuffered=tuple(u for lay in layouts for u in lay.unbuffered),
            version=versions.pop() if len(versions) == 1 else "",
        )

    def buffer(self, key: BufferKey) -> BufferLayout:
        """The buffer with ``key``.

        Raises:
            NotFoundError: with the keys that exist.
        """
        for b in self.buffers:
            if b.key == key:
                return b
        raise NotFoundError(f"no buffer {key}; buffers: {', '.join(str(b.key) for b in self.buffers)}")

    def locate(self, name: str, chunk: int = 0) -> tuple[BufferLayout, ParamLayout]:
        """The buffer and place of param ``name`` of model chunk ``chunk``.

        Raises:
            NotFoundError: the param is in no buffer of that chunk (frozen, unbuffered or unknown).
        """
        for b in self.buffers:
            if b.key.chunk != chunk:
                continue
            for p in b.params:
                if p.name == name:
                    return b, p
        raise NotFoundError(f"param {name!r} of chunk {chunk} is in no buffer")

    def params(self) -> Iterator[tuple[BufferLayout, ParamLayout]]:
        """Every ``(buffer, param)`` pair, buffer by buffer in layout order."""
        for b in self.buffers:
            for p in b.params:
                yield b, p

    def describe(self) -> str:
        """A multi-line, human-readable listing of every buffer, bucket and param."""
        lines = [f"ModelLayout (megatron-core {self.version or '?'}): {len(self.buffers)} buffer(s)"]
        for b in self.buffers:
            lines.append(
                f"  buffer {b.key}: dp={b.dp_size} numel={b.numel} numel_unpadded={b.numel_unpadded} "
                f"padding={b.padding} param_data={b.has_param_data}"
            )
            for k in b.buckets:
                lines.append(f"    bucket {k.index}: [{k.start}, {k.end}) numel_unpadded={k.numel_unpadded}")
                for p in b.bucket_params(k.index):
                    lines.append(f"      {p.name}: [{p.start}, {p.end}) shape={list(p.shape)}")
        for chunk, name in self.unbuffered:
            lines.append(f"  unbuffered: chunk{chunk} {name}")
        return "\n".join(lines)

    def diff(self, other: ModelLayout, max_lines: int = 40) -> str:
        """What differs between ``self`` ("left") and ``other`` ("right"); empty string when equal."""
        lines = _diff_layouts(self, other)
        if len(lines) > max_lines:
            lines = [*lines[:max_lines], f"... and {len(lines) - max_lines} more difference(s)"]
        return "\n".join(lines)


def _diff_layouts(left: ModelLayout, right: ModelLayout) -> list[str]:
    lines: list[str] = []
    lkeys = [b.key for b in left.buffers]
    rkeys = [b.key for b in right.buffers]
    for key in lkeys:
        if key not in rkeys:
            lines.append(f"buffer {key}: only on the left")
    for key in rkeys:
        if key not in lkeys:
            lines.append(f"buffer {key}: only on the right")
    common = [k for k in lkeys if k in rkeys]
    if common != [k for k in rkeys if k in lkeys]:
        lines.append(f"buffer order differs: left {[str(k) for k in lkeys]}, right {[str(k) for k in rkeys]}")
    for key in common:
        lines.extend(_diff_buffers(left.buffer(key), right.buffer(key)))
    if left.unbuffered != right.unbuffered:
        lines.append(f"unbuffered params: left {list(left.unbuffered)}, right {list(right.unbuffered)}")
    return lines


def _diff_buffers(left: BufferLayout, right: BufferLayout) -> list[str]:
    lines: list[str] = []
    where = f"buffer {left.key}"
    for attr in ("dp_size", "numel", "numel_unpadded", "has_param_data"):
        lv, rv = getattr(left, attr), getattr(right, attr)
        if lv != rv:
            lines.append(f"{where}: {attr} left {lv}, right {rv}")
    if left.buckets != right.buckets:
        lines.append(
            f"{where}: buckets left {[(k.start, k.end, k.numel_unpadded) for k in left.buckets]}, "
            f"right {[(k.start, k.end, k.numel_unpadded) for k in right.buckets]}"
        )
    lp = {p.name: p for p in left.params}
    rp = {p.name: p for p in right.params}
    for name in lp.keys() - rp.keys():
        lines.append(f"{where}: param {name} only on the left")
    for name in rp.keys() - lp.keys():
        lines.append(f"{where}: param {name} only on the right")
    for name in [n for n in lp if n in rp]:
        a, b = lp[name], rp[name]
        if a != b:
            lines.append(
                f"{where}: param {name}: left [{a.start}, {a.end}) bucket {a.bucket} shape {list(a.shape)}, "
                f"right [{b.start}, {b.end}) bucket {b.bucket} shape {list(b.shape)}"
            )
    if not lines and left.params != right.params:
        lines.append(f"{where}: param order differs: left {[p.name for p in left.params]}, "
                     f"right {[p.name for p in right.params]}")
    return lines


@dataclass(frozen=True)
class ParamSpec:
    """What :func:`compute_layout` needs to know about one parameter (no tensor needed).

    Attributes:
        name: name in ``named_parameters()``.
        shape: the parameter's shape.
        dtype: the parameter's dtype.
        requires_grad: frozen params (``False``) are in no buffer.
        expert: expert-parallel param (Megatron's ``param.allreduce == False``).
        shared_embedding: Megatron's ``param.shared_embedding`` (tied embedding/output weight on the first/last
            pipeline stage); gets a bucket of its own with the distributed optimizer (0.6+).
        layer_wise: Megatron's ``param.is_managed_by_layer_wise_optimizer`` (0.18+ buffer key).
        storage_dtype: the buffer's param dtype when it differs from ``dtype`` (``torch.uint8`` for TE float8
            params, 0.9+); ``None`` means ``dtype``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = True
    expert: bool = False
    shared_embedding: bool = False
    layer_wise: bool = False
    storage_dtype: torch.dtype | None = None

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @classmethod
    def from_parameter(cls, name: str, param: torch.Tensor) -> ParamSpec:
        """Read the spec of a real (or meta) parameter, including Megatron's attributes on it."""
        return cls(
            name=name,
            shape=tuple(int(s) for s in param.shape),
            dtype=param.dtype,
            requires_grad=bool(param.requires_grad),
            expert=not getattr(param, "allreduce", True),
            shared_embedding=bool(getattr(param, "shared_embedding", False)),
            layer_wise=bool(getattr(param, "is_managed_by_layer_wise_optimizer", False)),
        )


ParamsArg = Iterable[Union[ParamSpec, tuple[str, torch.Tensor], tuple[torch.Tensor, str]]]
