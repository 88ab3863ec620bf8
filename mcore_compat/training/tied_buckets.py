"""Refuse, before DDP is built, a model whose tied embedding would lie in two gradient buckets.

With the distributed optimizer, Megatron gives a pipeline-shared embedding/output weight (``shared_embedding``) a
bucket of its own. On 0.7-0.12 it pads the end of the bucket before that weight to ``lcm(dp, 128)`` elements but
starts the weight at the unpadded index (``megatron/core/distributed/param_and_grad_buffer.py``: the ``if`` that
calls ``_does_param_require_new_bucket`` before placing the param; 0.13.0 starts the param at the padded end). When
the params before it do not end on a multiple of 128 elements (linear biases, odd sizes), the weight begins
inside the previous bucket: its gradient is then reduce-scattered partly with the wrong bucket, and
``DistributedOptimizer`` stops with ``Param should not be in param_gbuf_map; each param only belongs to a single
bucket`` (``megatron/core/optimizer/distrib_optimizer.py``), after DDP has rebound every param.

:func:`check_tied_buckets` computes the layout the release will build (:func:`~mcore_compat.layout.compute_layout`,
which follows the fact ``shared_embedding_split``) and raises before anything is built. No exact fix exists from
outside Megatron (the index is computed inside ``ParamAndGradBuffer.__init__``), so the error names the ways out.
"""

from __future__ import annotations

from typing import Any

from packaging.version import Version

from ..errors import UnsupportedVersionError

__all__ = ["can_straddle", "check_tied_buckets", "straddling_params"]

#: The ``shared_embedding_split`` modes that can start a shared-embedding param inside the bucket before it.
_CAN_STRADDLE = ("close_at_start", "dp_align_then_close")


def can_straddle(version: Version) -> bool:
    """Whether ``version`` may lay a tied embedding over two buckets (with the distributed optimizer, for some
    sizes): the fact ``shared_embedding_split`` is one of the modes that close the bucket before the weight
    without starting the weight at the bucket's padded end (0.6-0.12; 0.6 pads to the DP size only, so it never
    does in practice, but its rule is the same)."""
    from ..layout import layout_fact

    return layout_fact("shared_embedding_split", version) in _CAN_STRADDLE


def straddling_params(layout: Any) -> list[tuple[str, int, int]]:
    """The params of a :class:`~mcore_compat.layout.ModelLayout` that start before their own bucket does, i.e.
    inside the previous one: ``(name, param start, bucket start)``."""
    out = []
    for buffer in layout.buffers:
        starts = {b.index: b.start for b in buffer.buckets}
        out += [(p.name, p.start, starts[p.bucket]) for p in buffer.params if p.start < starts[p.bucket]]
    return out


def _any_stage(flag: bool, ps: Any) -> bool:
    """Whether ``flag`` holds on any rank of this rank's pipeline group (every stage calls DDP: one all-reduce)."""
    import torch
    import torch.distributed as dist

    group = ps.get_pipeline_model_parallel_group()
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def check_tied_buckets(chunk: Any, settings: Any, version: Version, *, data_parallel_group: Any = None,
                       disable_bucketing: bool = False) -> None:
    """Raise if DDP of ``version`` with ``settings`` would lay ``chunk``'s tied embedding over two buckets.

    Args:
        chunk: one model chunk, not wrapped yet.
        settings: the installed ``DistributedDataParallelConfig`` (0.7+; the only releases concerned).
        version: the installed release.
        data_parallel_group: the group DDP reduces over (default: parallel_state's DP x CP group).
        disable_bucketing: the DDP argument.

    Every rank of the pipeline group must call it (it is called from DDP's construction, which they all run):
    when the weight straddles on one stage, every stage raises, so none is left waiting in a collective.

    Raises:
        UnsupportedVersionError: the layout would straddle; the message names the param, the releases, the cause
            and the ways out.
    """
    from ..layout import LAYOUT_FACTS, compute_layout
    from ._common import default_dp_group, parallel_state

    if not can_straddle(version):
        return
    if not getattr(settings, "use_distributed_optimizer", False):
        return
    ps = parallel_state()
    bad: list[tuple[str, int, int]] = []
    if any(getattr(p, "shared_embedding", False) for p in chunk.parameters()):
        bad = straddling_params(compute_layout(
            chunk.named_parameters(), version=version,
            dp_size=int((data_parallel_group or default_dp_group()).size()),
            use_distributed_optimizer=True,
            overlap_grad_reduce=bool(getattr(settings, "overlap_grad_reduce", False)),
            bucket_size=getattr(settings, "bucket_size", None),
            grad_reduce_in_fp32=bool(getattr(settings, "grad_reduce_in_fp32", False)),
            pad_buckets_for_high_nccl_busbw=bool(getattr(settings, "pad_buckets_for_high_nccl_busbw", False)),
            disable_bucketing=disable_bucketing, pipeline_rank=int(ps.get_pipeline_model_parallel_rank())))
    if not _any_stage(bool(bad), ps):
        return
    fixed = LAYOUT_FACTS["shared_embedding_split"].where(lambda mode: mode not in (*_CAN_STRADDLE, "none"))
    ways_out = (f"Ways out: install a release where {fixed}, pass use_distributed_optimizer=False, or untie the "
                f"weights (share_embeddings_and_output_weights=False). Nothing was built.")
    if not bad:  # the other end of the tie straddles: every stage stops here, none waits in a collective
        raise UnsupportedVersionError(
            f"megatron-core {version} cannot train this model with the distributed optimizer: another pipeline "
            f"stage's tied embedding/output weight would lie in two gradient buckets (see that stage's error). "
            f"{ways_out}")
    name, start, bucket_start = bad[0]
    raise UnsupportedVersionError(
        f"megatron-core {version} cannot train this model with the distributed optimizer: the tied embedding/output "
        f"weight {name!r} would start at element {start} of its gradient buffer, inside the bucket before it (padded "
        f"to end at {bucket_start}). Megatron pads that bucket to 128 elements but starts the tied weight at the "
        f"unpadded index (distributed/param_and_grad_buffer.py), so the weight lies in two buckets and "
        f"DistributedOptimizer stops ('each param only belongs to a single bucket'); this happens when the params "
        f"before it do not end on a multiple of 128 elements, e.g. with linear biases. {ways_out}")
