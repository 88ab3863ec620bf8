"""Where every parameter lives in Megatron-Core's flat grad/param buffers, read and computed.

Megatron's ``DistributedDataParallel`` packs the trainable parameters of a model chunk into flat buffers
(``GradBuffer`` in 0.4/0.5, ``ParamAndGradBuffer`` in 0.6-0.8, ``_ParamAndGradBuffer`` from 0.9): each
parameter's ``main_grad`` (and, with the distributed optimizer from 0.6, its ``.data``) is a view of
``buffer[start:end]``. The exact offsets, the bucket boundaries and the padding changed many times between
releases. This module gives one answer for every release:

* :func:`layout_of` reads what Megatron actually built from the DDP-wrapped model chunks;
* :func:`compute_layout` derives the same layout from the parameter list and the DDP settings alone (before, or
  without, building DDP), following the rules measured in ``api-drift.md`` section C.

Both return a :class:`ModelLayout`; two layouts compare equal exactly when every buffer, bucket and parameter
offset agrees, and :meth:`ModelLayout.diff` says where they differ.

Every version-dependent fact is a row of :data:`LAYOUT_FACTS` (fact name -> version range -> value); the code
looks facts up there instead of comparing versions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Union

import torch
from packaging.version import Version

from ._ranges import feature_version, in_range, range_text
from .errors import McoreCompatError, UnsupportedVersionError

__all__ = [
    "DEFAULT_BUCKET_SIZE",
    "LAYOUT_FACTS",
    "BucketLayout",
    "BufferKey",
    "BufferLayout",
    "LayoutError",
    "ModelLayout",
    "ParamLayout",
    "ParamSpec",
    "compute_layout",
    "layout_fact",
    "layout_of",
]


class LayoutError(McoreCompatError, ValueError):
    """A layout cannot be computed or read: bad settings, or settings Megatron itself rejects."""


class _DefaultBucketSize:
    """Sentinel type of :data:`DEFAULT_BUCKET_SIZE`."""

    _instance: _DefaultBucketSize | None = None

    def __new__(cls) -> _DefaultBucketSize:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "DEFAULT_BUCKET_SIZE"

    def __reduce__(self) -> str:
        return "DEFAULT_BUCKET_SIZE"


#: ``bucket_size`` value meaning "not given": Megatron's default bucket size for the release.
DEFAULT_BUCKET_SIZE: Final = _DefaultBucketSize()

# --------------------------------------------------------------------------------------------------------------
# The table of version-dependent facts (api-drift.md section C and B.9).
# --------------------------------------------------------------------------------------------------------------

#: fact name -> ((PEP 440 range, value), ...). Ranges of one fact do not overlap; the first match wins.
LAYOUT_FACTS: Final[dict[str, tuple[tuple[str, Any], ...]]] = {
    # DDP attributes holding the buffers: (dense, expert). 0.4/0.5: a dict {grad dtype: GradBuffer}, and expert
    # params are in no buffer (they get a private main_grad).
    "ddp_buffer_attrs": ((">=0.4,<0.6", ("grad_buffers", None)),
                         (">=0.6", ("buffers", "expert_parallel_buffers"))),
    # Attribute of a buffer holding the flat gradient tensor.
    "grad_data_attr": ((">=0.4,<0.6", "data"), (">=0.6", "grad_data")),
    # What separates params into buffers: the grad dtype only; (param dtype, grad dtype) per dense/expert list;
    # BufferKey(param dtype, grad dtype, expert, managed by the layer-wise optimizer).
    "buffer_grouping": ((">=0.4,<0.6", "grad_dtype"),
                        (">=0.6,<0.18", "param_and_grad_dtype"),
                        (">=0.18", "buffer_key")),
    # Whether expert params (``param.allreduce == False``) get buffers of their own.
    "expert_buffers": ((">=0.4,<0.6", False), (">=0.6", True)),
    # Bucket ends are padded (distributed optimizer only) to lcm(dp, *factors).
    "bucket_end_factors": ((">=0.4,<0.7", ()), (">=0.7", (128,))),
    # Extra lcm factor with ddp_config.pad_buckets_for_high_nccl_busbw (None: the option does not exist).
    "high_nccl_busbw_factor": ((">=0.4,<0.12", None), (">=0.12", 2**16)),
    # Param starts are aligned to this many elements (distributed optimizer only).
    "param_start_alignment": ((">=0.4,<0.8", 1), (">=0.8", 64)),
    # How a ``shared_embedding`` param gets a bucket of its own (distributed optimizer only):
    #   none                -- no special case;
    #   close_at_start      -- close the running bucket at the param's start, param stays there (Megatron asserts
    #                          start % dp == 0);
    #   dp_align_then_close -- pad the start to a bucket end if it is not a multiple of dp, close the running
    #                          bucket there, param stays at that start (may overlap the bucket's padding);
    #   start_after_close   -- close the running bucket, the param starts at its padded end.
    "shared_embedding_split": ((">=0.4,<0.6", "none"),
                               (">=0.6,<0.9", "close_at_start"),
                               (">=0.9,<0.13", "dp_align_then_close"),
                               (">=0.13", "start_after_close")),
    # A bucket is closed by size only once it holds at least this many params.
    "min_params_per_sized_bucket": ((">=0.4,<0.6", 2), (">=0.6", 1)),
    # Buckets record numel_unpadded.
    "bucket_numel_unpadded": ((">=0.4,<0.5", False), (">=0.5", True)),
    # Buffers record numel_unpadded.
    "buffer_numel_unpadded": ((">=0.4,<0.9", False), (">=0.9", True)),
    # Buffers hold a flat param_data tensor when the distributed optimizer is used.
    "param_data_with_distopt": ((">=0.4,<0.6", False), (">=0.6", True)),
    # Default bucket size: "fixed" = 40_000_000; "scaled" = max(40_000_000, 1_000_000 * dp).
    "default_bucket_size": ((">=0.4,<0.7", "fixed"), (">=0.7", "scaled")),
    # What an explicit ``bucket_size=None`` means: the DDP argument (0.4-0.6) -> one bucket;
    # ``ddp_config.bucket_size`` (0.7+) -> the default.
    "bucket_size_none": ((">=0.4,<0.7", "single_bucket"), (">=0.7", "default")),
}

_MIN_VERSION: Final = Version("0.4.0")


def layout_fact(name: str, version: Version | str) -> Any:
    """The value of fact ``name`` of :data:`LAYOUT_FACTS` for ``version``.

    Raises:
        KeyError: unknown fact.
        UnsupportedVersionError: ``version`` is older than 0.4.0 (no row covers it).
    """
    if name not in LAYOUT_FACTS:
        raise KeyError(f"unknown layout fact {name!r}; known: {', '.join(LAYOUT_FACTS)}")
    for spec, value in LAYOUT_FACTS[name]:
        if in_range(version, spec):
            return value
    covered = "; ".join(range_text(spec) for spec, _ in LAYOUT_FACTS[name])
    raise UnsupportedVersionError(
        f"megatron-core {version} is not covered by the buffer-layout table (fact {name!r} covers {covered}); "
        f"mcore-compat supports 0.4.0 and later."
    )


def _resolve_version(version: Version | str | None) -> Version:
    if version is None:
        from .detect import detect

        version = detect().version
    v = feature_version(version)
    if v < _MIN_VERSION:
        raise UnsupportedVersionError(f"megatron-core {version} is older than 0.4.0, which mcore-compat does not support")
    return v


# --------------------------------------------------------------------------------------------------------------
# Data model.
# --------------------------------------------------------------------------------------------------------------


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
        numel_unpadded: Megatron's ``numel_unpadded`` (sum of the buckets' ``numel_unpadded``; 0.9+, else
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
            KeyError: no such param in this buffer.
        """
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"no param {name!r} in buffer {self.key}")

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
            KeyError: with the keys that exist.
        """
        for b in self.buffers:
            if b.key == key:
                return b
        raise KeyError(f"no buffer {key}; buffers: {', '.join(str(b.key) for b in self.buffers)}")

    def locate(self, name: str, chunk: int = 0) -> tuple[BufferLayout, ParamLayout]:
        """The buffer and place of param ``name`` of model chunk ``chunk``.

        Raises:
            KeyError: the param is in no buffer of that chunk (frozen, unbuffered or unknown).
        """
        for b in self.buffers:
            if b.key.chunk != chunk:
                continue
            for p in b.params:
                if p.name == name:
                    return b, p
        raise KeyError(f"param {name!r} of chunk {chunk} is in no buffer")

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

# --------------------------------------------------------------------------------------------------------------
# compute_layout
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rules:
    """The layout rules of one release for one buffer, resolved from the table and the settings."""

    dp_size: int
    distributed_optimizer: bool
    bucket_size: int | None
    end_divisor: int
    start_alignment: int
    shared_embedding_split: str
    min_params_per_sized_bucket: int

    def pad_end(self, index: int) -> int:
        """Bucket-end padding (distributed optimizer only)."""
        return _ceil_to(index, self.end_divisor) if self.distributed_optimizer else index

    def pad_start(self, index: int) -> int:
        """Param-start alignment (distributed optimizer only)."""
        return _ceil_to(index, self.start_alignment) if self.distributed_optimizer else index

    def own_bucket(self, spec: ParamSpec) -> bool:
        """Whether ``spec`` gets a bucket of its own."""
        return (self.distributed_optimizer and spec.shared_embedding
                and self.shared_embedding_split != "none")


def _ceil_to(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor


class _BufferBuilder:
    """Walks the params of one buffer in layout order and records offsets and buckets (section C.2)."""

    def __init__(self, rules: _Rules) -> None:
        self.rules = rules
        self.params: list[ParamLayout] = []
        self.buckets: list[tuple[int, int, int]] = []  # (start, end, numel_unpadded)
        self.bucket_start = 0
        self.in_bucket = 0
        self.next_start = 0

    def close_bucket(self, end: int) -> int:
        """Close the running bucket at ``end``; returns the padded end (= start of the next bucket)."""
        unpadded = end - self.bucket_start
        end = self.rules.pad_end(end)
        self.buckets.append((self.bucket_start, end, unpadded))
        self.bucket_start = end
        self.in_bucket = 0
        return end

    def split_before(self, spec: ParamSpec, start: int) -> int:
        """Close the running bucket before a shared-embedding param; returns the param's start."""
        rules = self.rules
        mode = rules.shared_embedding_split
        if mode == "close_at_start":
            if start % rules.dp_size != 0:
                raise LayoutError(
                    f"Megatron-Core raises AssertionError for this model: shared-embedding param {spec.name!r} "
                    f"would start at {start}, which is not a multiple of the data-parallel size {rules.dp_size} "
                    f"(0.6-0.8 `assert data_start_index % data_parallel_world_size == 0`; api-drift.md C.2)"
                )
            self.close_bucket(start)
            return start
        if mode == "dp_align_then_close":
            if start % rules.dp_size != 0:
                start = rules.pad_end(start)
            self.close_bucket(start)
            return start
        return self.close_bucket(start)  # start_after_close

    def add(self, spec: ParamSpec) -> None:
        """Place ``spec`` after the params placed so far."""
        rules = self.rules
        start = rules.pad_start(self.next_start)
        own = rules.own_bucket(spec)
        if own and self.in_bucket:
            start = self.split_before(spec, start)
        end = start + spec.numel
        self.params.append(ParamLayout(spec.name, start, end, len(self.buckets), spec.shape))
        self.in_bucket += 1
        full = (rules.bucket_size is not None and end - self.bucket_start >= rules.bucket_size
                and self.in_bucket >= rules.min_params_per_sized_bucket)
        self.next_start = self.close_bucket(end) if full or own else end

    def finish(self) -> tuple[int, list[BucketLayout], tuple[ParamLayout, ...]]:
        """Close the last bucket; returns ``(numel, buckets, params)``."""
        if self.in_bucket:
            self.close_bucket(self.params[-1].end)
        buckets = [BucketLayout(i, s, e, u) for i, (s, e, u) in enumerate(self.buckets)]
        numel = buckets[-1].end if buckets else 0
        return numel, buckets, tuple(self.params)


def _to_specs(params_with_names: ParamsArg) -> list[ParamSpec]:
    """Normalise ``(name, param)``, ``(param, name)`` pairs or :class:`ParamSpec` items; shared params once."""
    specs: list[ParamSpec] = []
    seen: set[int] = set()
    for item in params_with_names:
        if isinstance(item, ParamSpec):
            specs.append(item)
            continue
        first, second = item
        name, param = (first, second) if isinstance(first, str) else (second, first)
        if not isinstance(name, str) or not isinstance(param, torch.Tensor):
            raise LayoutError(f"expected (name, parameter) pairs or ParamSpec, got {item!r:.80}")
        if id(param) in seen:
            continue
        seen.add(id(param))
        specs.append(ParamSpec.from_parameter(name, param))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise LayoutError(f"duplicate parameter names: {sorted({n for n in names if names.count(n) > 1})}")
    return specs


def _effective_bucket_size(
    version: Version,
    bucket_size: int | _DefaultBucketSize | None,
    dp_size: int,
    overlap_grad_reduce: bool,
    disable_bucketing: bool,
    pipeline_rank: int,
) -> int | None:
    """The bucket size the buffers get (``None``: one bucket), per section B.9."""
    if bucket_size is None and layout_fact("bucket_size_none", version) == "default":
        bucket_size = DEFAULT_BUCKET_SIZE
    if isinstance(bucket_size, _DefaultBucketSize):
        fixed = 40_000_000
        bucket_size = fixed if layout_fact("default_bucket_size", version) == "fixed" else max(fixed, 1_000_000 * dp_size)
    if not overlap_grad_reduce or disable_bucketing or pipeline_rank > 0:
        return None
    if bucket_size is not None and bucket_size <= 0:
        raise LayoutError(f"bucket_size must be positive, got {bucket_size}")
    return bucket_size


def _group_specs(
    specs: Sequence[ParamSpec], version: Version, grad_reduce_in_fp32: bool, chunk: int
) -> tuple[list[tuple[BufferKey, list[ParamSpec]]], list[ParamSpec]]:
    """Split trainable params into buffers (dense first, then expert; each in first-appearance order)."""
    grouping = layout_fact("buffer_grouping", version)
    expert_buffers = layout_fact("expert_buffers", version)
    groups: dict[BufferKey, list[ParamSpec]] = {}
    unbuffered: list[ParamSpec] = []
    for spec in specs:
        if not spec.requires_grad:
            continue
        if spec.expert and not expert_buffers:
            unbuffered.append(spec)
            continue
        grad_dtype = torch.float32 if grad_reduce_in_fp32 else spec.dtype
        param_dtype = None if grouping == "grad_dtype" else (spec.storage_dtype or spec.dtype)
        layer_wise = spec.layer_wise and grouping == "buffer_key"
        key = BufferKey(chunk, param_dtype, grad_dtype, spec.expert, layer_wise)
        groups.setdefault(key, []).append(spec)
    ordered = [(k, v) for k, v in groups.items() if not k.is_expert_parallel]
    ordered += [(k, v) for k, v in groups.items() if k.is_expert_parallel]
    return ordered, unbuffered


def _rules_for(
    version: Version,
    dp_size: int,
    use_distributed_optimizer: bool,
    bucket_size: int | None,
    pad_buckets_for_high_nccl_busbw: bool,
) -> _Rules:
    factors = list(layout_fact("bucket_end_factors", version))
    if pad_buckets_for_high_nccl_busbw:
        factors.append(layout_fact("high_nccl_busbw_factor", version))
    return _Rules(
        dp_size=dp_size,
        distributed_optimizer=use_distributed_optimizer,
        bucket_size=bucket_size,
        end_divisor=math.lcm(dp_size, *factors),
        start_alignment=layout_fact("param_start_alignment", version),
        shared_embedding_split=layout_fact("shared_embedding_split", version),
        min_params_per_sized_bucket=layout_fact("min_params_per_sized_bucket", version),
    )


def _lay_out_buffer(
    key: BufferKey, specs: Sequence[ParamSpec], rules: _Rules, version: Version
) -> BufferLayout:
    builder = _BufferBuilder(rules)
    for spec in reversed(specs):
        builder.add(spec)
    numel, buckets, params = builder.finish()
    if not layout_fact("bucket_numel_unpadded", version):
        buckets = [BucketLayout(k.index, k.start, k.end, None) for k in buckets]
    total_unpadded = sum(k.numel_unpadded or 0 for k in buckets)
    return BufferLayout(
        key=key,
        dp_size=rules.dp_size,
        numel=numel,
        numel_unpadded=total_unpadded if layout_fact("buffer_numel_unpadded", version) else None,
        buckets=tuple(buckets),
        params=params,
        has_param_data=rules.distributed_optimizer and layout_fact("param_data_with_distopt", version),
    )


def compute_layout(
    params_with_names: ParamsArg,
    *,
    version: Version | str | None = None,
    dp_size: int,
    expert_dp_size: int | None = None,
    use_distributed_optimizer: bool = False,
    overlap_grad_reduce: bool = False,
    bucket_size: int | _DefaultBucketSize | None = DEFAULT_BUCKET_SIZE,
    grad_reduce_in_fp32: bool = False,
    pad_buckets_for_high_nccl_busbw: bool = False,
    disable_bucketing: bool = False,
    pipeline_rank: int = 0,
    chunk: int = 0,
) -> ModelLayout:
    """The buffer layout Megatron-Core ``version`` builds for one model chunk, from its params and settings.

    Args:
        params_with_names: the chunk's params in ``named_parameters()`` order: ``(name, param)`` pairs (e.g.
            ``module.named_parameters()``), ``(param, name)`` pairs, or :class:`ParamSpec` items. Frozen params
            are skipped; a param object listed twice counts once (first name).
        version: the megatron-core release (default: the installed one).
        dp_size: size of the group the dense buffers are reduced over (DP x CP; with several distributed-optimizer
            instances, the size of one instance). Also used for the default bucket size (Megatron uses DP without
            CP there: pass ``bucket_size`` explicitly when CP > 1 and DP > 40).
        expert_dp_size: size of the expert data-parallel group (default ``dp_size``).
        use_distributed_optimizer: ``ddp_config.use_distributed_optimizer`` (the DDP argument in 0.4-0.6).
        overlap_grad_reduce: ``ddp_config.overlap_grad_reduce``; without it everything is one bucket.
        bucket_size: what was given to Megatron (``ddp_config.bucket_size``, or the DDP argument in 0.4-0.6).
            :data:`DEFAULT_BUCKET_SIZE` = not given. ``None`` means the default in 0.7+ and one bucket in 0.4-0.6,
            exactly as in Megatron.
        grad_reduce_in_fp32: ``ddp_config.grad_reduce_in_fp32`` (``accumulate_allreduce_grads_in_fp32`` in 0.4-0.6).
        pad_buckets_for_high_nccl_busbw: ``ddp_config.pad_buckets_for_high_nccl_busbw`` (0.12+).
        disable_bucketing: the DDP argument ``disable_bucketing``.
        pipeline_rank: pipeline stage of this rank; stages after the first get one bucket.
        chunk: model-chunk index recorded in the buffer keys (combine chunks with :meth:`ModelLayout.combine`).

    Returns:
        The layout; equal to :func:`layout_of` of the DDP Megatron builds with these settings.

    Raises:
        LayoutError: invalid settings, or a model Megatron itself rejects (0.6-0.8 shared-embedding assertion).
        UnsupportedVersionError: a release older than 0.4.0.

    Not covered: the layer-wise optimizer's own layout (0.18+, used only when its ``full_param_layout`` is passed
    to DDP) and NVFP4/MXFP8 buffer sharing; params tagged ``layer_wise`` get their own buffer laid out by the
    rules DDP uses when no layout is passed.
    """
    v = _resolve_version(version)
    if dp_size < 1 or (expert_dp_size is not None and expert_dp_size < 1):
        raise LayoutError(f"group sizes must be >= 1, got dp_size={dp_size}, expert_dp_size={expert_dp_size}")
    if pad_buckets_for_high_nccl_busbw and layout_fact("high_nccl_busbw_factor", v) is None:
        raise LayoutError(f"pad_buckets_for_high_nccl_busbw does not exist in megatron-core {v} (0.12+)")
    effective = _effective_bucket_size(v, bucket_size, dp_size, overlap_grad_reduce, disable_bucketing,
                                       pipeline_rank)
    groups, unbuffered = _group_specs(_to_specs(params_with_names), v, grad_reduce_in_fp32, chunk)
    buffers = []
    for key, specs in groups:
        group_size = (expert_dp_size or dp_size) if key.is_expert_parallel else dp_size
        rules = _rules_for(v, group_size, use_distributed_optimizer, effective, pad_buckets_for_high_nccl_busbw)
        buffers.append(_lay_out_buffer(key, specs, rules, v))
    return ModelLayout(tuple(buffers), tuple((chunk, s.name) for s in unbuffered), str(v))


# --------------------------------------------------------------------------------------------------------------
# layout_of
# --------------------------------------------------------------------------------------------------------------

#: Wrapper classes stripped to find the module whose parameter names the user sees.
_WRAPPER_CLASS_NAMES: Final = frozenset({
    "DistributedDataParallel", "Float16Module", "FullyShardedDataParallel", "TorchFullyShardedDataParallel",
})


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while type(module).__name__ in _WRAPPER_CLASS_NAMES and isinstance(getattr(module, "module", None),
                                                                        torch.nn.Module):
        module = module.module
    return module


def _ddp_buffers(chunk: Any, version: Version) -> list[tuple[Any, bool]]:
    """``(buffer, is_expert)`` of one DDP-wrapped chunk, in Megatron's order."""
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
    v = _resolve_version(version)
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    buffers: list[BufferLayout] = []
    unbuffered: list[tuple[int, str]] = []
    for index, chunk in enumerate(chunks):
        order: dict[torch.Tensor, tuple[int, str]] = {}
        for position, (name, param) in enumerate(_unwrap(chunk).named_parameters()):
            order[param] = (position, name)
        held: set[torch.Tensor] = set()
        for buffer, is_expert in _ddp_buffers(chunk, v):
            key = _buffer_key(buffer, index, is_expert, v)
            buffers.append(_read_buffer(buffer, key, order, v))
            held.update(buffer.param_index_map)
        unbuffered.extend((index, name) for param, (_, name) in order.items()
                          if param.requires_grad and param not in held)
    return ModelLayout(tuple(buffers), tuple(unbuffered), str(v))
