"""The version-dependent facts of Megatron-Core's flat grad/param buffers: :data:`LAYOUT_FACTS` and :func:`layout_fact`.

Every version-dependent fact of the buffer layout is a row of :data:`LAYOUT_FACTS` (fact name -> version range ->
value); the code of :mod:`mcore_compat.layout` looks facts up here instead of comparing versions.
"""

from __future__ import annotations

from typing import Any, Final

from packaging.version import Version

from .._ranges import in_range, range_text
from ..errors import UnsupportedVersionError

__all__ = ["LAYOUT_FACTS", "layout_fact"]

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
