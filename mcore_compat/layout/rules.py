"""The rules that place params and bucket boundaries in one buffer, for one release and one set of DDP settings.

:func:`rules_for` resolves the rules from :data:`~mcore_compat.layout.LAYOUT_FACTS`; :class:`BufferBuilder` walks
a buffer's params in layout order and records where each one goes (Megatron's ``_ParamAndGradBuffer.__init__`` in
``megatron/core/distributed/param_and_grad_buffer.py``, ``GradBuffer`` in ``grad_buffer.py`` on 0.4/0.5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from packaging.version import Version

from .facts import layout_fact
from .model import BucketLayout, LayoutError, ParamLayout, ParamSpec

__all__ = ["BufferBuilder", "Rules", "rules_for"]


@dataclass(frozen=True)
class Rules:
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


class BufferBuilder:
    """Walks the params of one buffer in layout order and records offsets and buckets (Megatron's ``_ParamAndGradBuffer.__init__``)."""

    def __init__(self, rules: Rules) -> None:
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
                    f"(0.6-0.8 `assert data_start_index % data_parallel_world_size == 0` in "
                    "megatron/core/distributed/param_and_grad_buffer.py)"
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


def rules_for(
    version: Version,
    dp_size: int,
    use_distributed_optimizer: bool,
    bucket_size: int | None,
    pad_buckets_for_high_nccl_busbw: bool,
) -> Rules:
    """The rules for one buffer of release ``version`` under the given DDP settings.

    Args:
        version: the megatron-core release.
        dp_size: size of the group the buffer is reduced over.
        use_distributed_optimizer: pads bucket ends and aligns param starts (no padding without it).
        bucket_size: the effective bucket size (``None``: one bucket).
        pad_buckets_for_high_nccl_busbw: ``ddp_config.pad_buckets_for_high_nccl_busbw`` (0.12+).

    Returns:
        The resolved rules.
    """
    factors = list(layout_fact("bucket_end_factors", version))
    if pad_buckets_for_high_nccl_busbw:
        factors.append(layout_fact("high_nccl_busbw_factor", version))
    return Rules(
        dp_size=dp_size,
        distributed_optimizer=use_distributed_optimizer,
        bucket_size=bucket_size,
        end_divisor=math.lcm(dp_size, *factors),
        start_alignment=layout_fact("param_start_alignment", version),
        shared_embedding_split=layout_fact("shared_embedding_split", version),
        min_params_per_sized_bucket=layout_fact("min_params_per_sized_bucket", version),
    )
