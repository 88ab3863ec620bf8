"""The buffer layout Megatron-Core builds, computed from the parameter list and the DDP settings alone.

:func:`compute_layout` gives, before (or without) building DDP, the layout that
:func:`~mcore_compat.layout.layout_of` reads from the DDP Megatron builds with the same settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch
from packaging.version import Version

from .facts import LAYOUT_FACTS, layout_fact
from .model import BucketLayout, BufferKey, BufferLayout, LayoutError, ModelLayout, ParamsArg, ParamSpec
from .rules import BufferBuilder, Rules, rules_for
from .version import resolve_version

__all__ = ["DEFAULT_BUCKET_SIZE", "compute_layout"]


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
    """The bucket size the buffers get (``None``: one bucket), as Megatron derives it from ``bucket_size`` and the DDP settings."""
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



def _lay_out_buffer(
    key: BufferKey, specs: Sequence[ParamSpec], rules: Rules, version: Version
) -> BufferLayout:
    builder = BufferBuilder(rules)
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
    v = resolve_version(version)
    if dp_size < 1 or (expert_dp_size is not None and expert_dp_size < 1):
        raise LayoutError(f"group sizes must be >= 1, got dp_size={dp_size}, expert_dp_size={expert_dp_size}")
    if pad_buckets_for_high_nccl_busbw and layout_fact("high_nccl_busbw_factor", v) is None:
        since = LAYOUT_FACTS["high_nccl_busbw_factor"].where(lambda factor: factor is not None)
        raise LayoutError(f"pad_buckets_for_high_nccl_busbw does not exist in megatron-core {v} ({since})")
    effective = _effective_bucket_size(v, bucket_size, dp_size, overlap_grad_reduce, disable_bucketing,
                                       pipeline_rank)
    groups, unbuffered = _group_specs(_to_specs(params_with_names), v, grad_reduce_in_fp32, chunk)
    buffers = []
    for key, specs in groups:
        group_size = (expert_dp_size or dp_size) if key.is_expert_parallel else dp_size
        rules = rules_for(v, group_size, use_distributed_optimizer, effective, pad_buckets_for_high_nccl_busbw)
        buffers.append(_lay_out_buffer(key, specs, rules, v))
    return ModelLayout(tuple(buffers), tuple((chunk, s.name) for s in unbuffered), str(v))
