"""Full, unsharded weights from any TP x PP x EP (+ virtual pipeline) layout, moved as flat-buffer slices.

:func:`iter_full` and :func:`gather_full` give the tensors of the model a single rank would build with the same
config (TP = PP = EP = 1), under its names. Every rank's :class:`~.manifest.Manifest` (format 2: single-rank
name, TP partition dim and stride, expert index, tied pair per parameter) is exchanged once; from them every rank
plans the same transfer:

1. each full tensor needs one piece per TP rank (one piece when it is duplicated over TP); the first rank of the
   group holding a piece sends it (DP and expert-DP replicas send nothing; a tied output-layer copy is skipped:
   the input embedding stands for it);
2. full tensors are taken in order into buckets of at most ``bucket_bytes`` (output bytes, and bytes of each
   slice sent); for each bucket each source rank sends, per flat buffer, the one contiguous slice that holds its
   pieces (one collective per flat buffer slice: a ``broadcast`` over the group, or ``send``/``recv`` to
   ``dst``);
3. the receiver puts every element in its place with one ``index_select`` per bucket (the index, planned once
   with :func:`~.placement.place_shard` on element positions, is the TP concatenation along
   ``partition_dim``, stride-interleaved), then frees the received slices.

Peak memory beyond the output: one bucket of received slices (at most ``bucket_bytes``, or one tensor's shards
when they are larger). Inconsistent manifests (a tensor's TP shards disagreeing on dim, stride or size; an expert claimed by
two EP ranks; one name on two pipeline stages; a missing shard) are refused before anything moves.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from .errors import BindingError
from .manifest import Manifest, ManifestEntry
from .param_binding import ParamBinding
from .placement import place_shard
from .views import contiguous_strides, dtype_from_name, numel

__all__ = ["DEFAULT_BUCKET_BYTES", "gather_full", "iter_full"]

#: Default bucket size of :func:`gather_full` (bytes): large enough that a small model moves one slice per flat
#: buffer, small enough to bound the staging memory of a large one.
DEFAULT_BUCKET_BYTES: Final = 512 * 2**20


@dataclass
class _Full:
    """One tensor of the single-rank model and its pieces: ``{piece index: (group rank, entry)}``."""

    name: str
    first: ManifestEntry
    pieces: dict[int, tuple[int, ManifestEntry]] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, ...]:
        e = self.first
        if not e.tp_split:
            return e.shape
        shape = list(e.shape)
        shape[e.partition_dim] *= e.tp_size
        return tuple(shape)

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * dtype_from_name(self.first.dtype).itemsize


def _conflict(name: str, a: ManifestEntry, b: ManifestEntry) -> str | None:
    for attr in ("tp_split", "partition_dim", "partition_stride", "tp_size", "dtype", "shape", "expert"):
        if getattr(a, attr) != getattr(b, attr):
            return f"{name}: {attr} {getattr(a, attr)!r} on one rank, {getattr(b, attr)!r} on another"
    return None


def plan(manifests: list[Manifest]) -> list[_Full]:
    """The single-rank tensors and which group rank sends each piece (see the module docstring).

    Raises:
        BindingError: a version 1 manifest, or manifests that do not describe one model consistently.
    """
    out: dict[str, _Full] = {}
    for rank, m in enumerate(manifests):
        for e in m.params:
            if e.full_name is None:
                raise BindingError(f"rank {rank}'s manifest (format_version {m.format_version}) says nothing about "
                                   f"the single-rank model; gather_full needs format_version 2")
            if e.tied_to is not None:
                continue
            if e.expert == -1:
                raise BindingError(f"{e.full_name}: an expert-parallel parameter holding several experts at once "
                                   f"(grouped GEMM: the legacy GroupedMLP); gather_full cannot reassemble it. "
                                   f"Build the experts with SequentialMLP or TEGroupedMLP (moe_grouped_gemm=False or "
                                   f"the TE spec)")
            if e.tp_split and not (0 <= e.partition_dim < len(e.shape) and e.partition_stride >= 1
                                   and e.shape[e.partition_dim] % e.partition_stride == 0):
                raise BindingError(f"{e.full_name}: partition_dim {e.partition_dim} / stride "
                                   f"{e.partition_stride} do not fit its shard shape {list(e.shape)}")
            full = out.setdefault(e.full_name, _Full(e.full_name, e))
            problem = _conflict(e.full_name, full.first, e)
            if problem:
                raise BindingError(f"the ranks' manifests disagree: {problem}")
            piece = e.tp_rank if e.tp_split else 0
            held = full.pieces.get(piece)
            if held is None:
                full.pieces[piece] = (rank, e)
            elif e.expert is not None and held[1].ep_rank != e.ep_rank:
                raise BindingError(f"{e.full_name}: expert {e.expert} is claimed by EP ranks {held[1].ep_rank} "
                                   f"and {e.ep_rank}")
            elif (held[1].pp_rank, held[1].vp_stage) != (e.pp_rank, e.vp_stage):
                raise BindingError(f"{e.full_name}: held by pipeline stage {held[1].pp_rank} (virtual "
                                   f"{held[1].vp_stage}) and {e.pp_rank} (virtual {e.vp_stage}): the modules of "
                                   f"different stages have the same names (no global layer_number to tell them "
                                   f"apart)")
    for full in out.values():
        want = set(range(full.first.tp_size)) if full.first.tp_split else {0}
        if set(full.pieces) != want:
            raise BindingError(f"{full.name}: TP shards {sorted(full.pieces)} held, {sorted(want)} needed")
    return list(out.values())


def _buckets(fulls: list[_Full], bucket_bytes: int) -> Iterator[list[_Full]]:
    """Consecutive tensors of one dtype whose output bytes, and the bytes of the slices sent for them, each stay
    within ``bucket_bytes`` (at least one tensor per bucket)."""
    bucket: list[_Full] = []
    spans: dict[tuple[int, int], tuple[int, int]] = {}
    size = 0

    def grown(full: _Full) -> dict[tuple[int, int], tuple[int, int]]:
        new = dict(spans)
        for rank, e in full.pieces.values():
            lo, hi = new.get((rank, e.buffer), (e.offset, e.offset + e.numel))
            new[(rank, e.buffer)] = (min(lo, e.offset), max(hi, e.offset + e.numel))
        return new

    for full in fulls:
        new = grown(full)
        item = dtype_from_name(full.first.dtype).itemsize
        too_big = size + full.nbytes > bucket_bytes or sum(hi - lo for lo, hi in new.values()) * item > bucket_bytes
        if bucket and (too_big or full.first.dtype != bucket[0].first.dtype):
            yield bucket
            bucket, spans, size = [], {}, 0
            new = grown(full)
        bucket.append(full)
        spans, size = new, size + full.nbytes
    if bucket:
        yield bucket


@dataclass
class _Source:
    """One slice sent for a bucket: ``flat_buffers()[buffer][lo:hi]`` of group rank ``rank``, received at
    ``at`` of the bucket's staging tensor."""

    rank: int
    buffer: int
    lo: int
    hi: int
    at: int


#: Tensors of at least this many elements are put in place by block copies; smaller ones by one index_select.
_BLOCK_COPY_NUMEL: Final = 1 << 16


@dataclass(frozen=True)
class _Copy:
    """A large tensor's piece: staging ``[at:at + numel(shape)]`` viewed as ``shape`` goes to output ``out`` as TP
    rank ``piece`` of ``tp`` (``dim`` < 0: the whole tensor)."""

    out: int
    full: tuple[int, ...]
    at: int
    shape: tuple[int, ...]
    dim: int
    stride: int
    piece: int
    tp: int


@dataclass
class _Bucket:
    """One bucket's transfer, planned once: the slices to move, then the TP concatenation as one ``index_select``
    (``index``: for each element of the small tensors, packed first in the output, its place in the staging
    tensor) and block copies for the large tensors (``copies``)."""

    dtype: torch.dtype
    sources: list[_Source]
    staging: int
    total: int
    index: torch.Tensor
    copies: list[_Copy]
    outputs: list[tuple[str, int, tuple[int, ...], tuple[int, ...]]]  # name, offset, shape, strides
    on_device: dict[torch.device, torch.Tensor] = field(default_factory=dict)

    def index_on(self, device: torch.device) -> torch.Tensor:
        if device not in self.on_device:
            self.on_device[device] = self.index.to(device)
        return self.on_device[device]


def _plan_bucket(bucket: list[_Full]) -> _Bucket:
    spans: dict[tuple[int, int], list[int]] = {}
    for f in bucket:
        for rank, e in f.pieces.values():
            span = spans.setdefault((rank, e.buffer), [e.offset, e.offset + e.numel])
            span[0], span[1] = min(span[0], e.offset), max(span[1], e.offset + e.numel)
    sources, at = [], 0
    for (rank, buffer), (lo, hi) in sorted(spans.items()):
        sources.append(_Source(rank, buffer, lo, hi, at))
        at += hi - lo
    base = {(s.rank, s.buffer): s.at - s.lo for s in sources}
    small = [f for f in bucket if numel(f.shape) < _BLOCK_COPY_NUMEL]
    n_small = sum(numel(f.shape) for f in small)
    index = torch.empty(n_small, dtype=torch.long)
    where: dict[str, int] = {}
    o = 0
    for f in small:
        n = numel(f.shape)
        target = index[o:o + n].view(f.shape)
        for piece, (rank, e) in f.pieces.items():
            start = base[(rank, e.buffer)] + e.offset
            positions = torch.arange(start, start + e.numel, dtype=torch.long).view(e.shape)
            if e.tp_split:
                place_shard(target, positions, e.partition_dim, e.partition_stride, piece, e.tp_size)
            else:
                target.copy_(positions)
        where[f.name] = o
        o += n
    copies = []
    for f in bucket:
        if f.name in where:
            continue
        where[f.name] = o
        for piece, (rank, e) in f.pieces.items():
            copies.append(_Copy(o, f.shape, base[(rank, e.buffer)] + e.offset, e.shape,
                                e.partition_dim if e.tp_split else -1, e.partition_stride, piece, e.tp_size))
        o += numel(f.shape)
    outputs = [(f.name, where[f.name], f.shape, contiguous_strides(f.shape)) for f in bucket]
    return _Bucket(dtype_from_name(bucket[0].first.dtype), sources, at, o, index, copies, outputs)


def _staging(binding: ParamBinding, b: _Bucket, device: torch.device, reuse: bool) -> torch.Tensor:
    """A receive tensor for bucket ``b``: fresh, or (``reuse``) one per dtype and device kept on the binding
    (grown when needed), so repeated gathers neither allocate nor fault in fresh pages."""
    if not reuse:
        return torch.empty(b.staging, dtype=b.dtype, device=device)
    key = (b.dtype, device)
    held = binding._full_staging.get(key)
    if held is None or held.numel() < b.staging:
        binding._full_staging.pop(key, None)
        held = torch.empty(b.staging, dtype=b.dtype, device=device)
        binding._full_staging[key] = held
    return held[:b.staging]


def _assemble(b: _Bucket, staging: torch.Tensor) -> torch.Tensor:
    """The bucket's output: the small tensors by one ``index_select``, the large ones by block copies."""
    out = torch.empty(b.total, dtype=b.dtype, device=staging.device)
    n_small = b.index.numel()
    if n_small:
        torch.index_select(staging, 0, b.index_on(staging.device), out=out[:n_small])
    for c in b.copies:
        shard = staging[c.at:c.at + numel(c.shape)].view(c.shape)
        full = out[c.out:c.out + numel(c.full)].view(c.full)
        if c.dim < 0:
            full.copy_(shard)
        else:
            place_shard(full, shard, c.dim, c.stride, c.piece, c.tp)
    return out


def _planned(binding: ParamBinding, group: Any, bucket_bytes: int) -> list[_Bucket]:
    """The buckets of ``binding`` over ``group`` (collective the first time; cached on the binding with the
    manifests they were planned from)."""
    import torch.distributed as dist

    manifests = binding._manifests_over(group)
    key = (tuple(dist.get_process_group_ranks(group)), bucket_bytes)
    cached = binding._full_plans.get(key)
    if cached is not None and cached[0] is manifests:
        return cached[1]
    unbound: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(unbound, list(binding.unbound), group=group)
    missing = sorted({n for names in unbound for n in names})
    if missing:
        raise BindingError(f"{len(missing)} parameter(s) are not bound (frozen, left out by dtype=, or expert params "
                           f"in no DDP buffer on 0.4/0.5), so gather_full would leave them out: "
                           f"{', '.join(missing[:5])}")
    buckets = [_plan_bucket(b) for b in _buckets(plan(manifests), bucket_bytes)]
    binding._full_plans[key] = (manifests, buckets)
    return buckets


def _default_group() -> Any:
    import torch.distributed as dist

    return dist.group.WORLD


def iter_full(binding: ParamBinding, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dst: int | None = None,
              group: Any = None, reuse_buffers: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(single-rank name, full tensor)`` bucket by bucket; every member of ``group`` must exhaust it.

    Collective: each bucket is a round of collectives that every member of ``group`` takes part in, so every rank
    iterates to the end (ranks other than ``dst`` yield nothing). The tensors of one bucket are views of one new
    tensor (never of the flat buffers); dropping a bucket's tensors once an engine has loaded them bounds the
    memory to one bucket of output plus one bucket of received slices. The first call plans the transfer (one
    ``all_gather_object`` of the manifests and of the unbound names) and caches it on the binding.

    Args:
        binding: this rank's binding (:func:`~mcore_compat.binding.bind_params`) after any training steps.
        bucket_bytes: bound on the bytes of full tensors per bucket and of the slices received for it; a tensor
            larger than that travels alone.
        dst: group rank that receives (the others only send); ``None``: every member receives.
        group: the ranks holding the model, every one of its TP x PP x EP (and DP) ranks (default: the world).
        reuse_buffers: receive into one tensor per dtype and device kept on the binding (at most one bucket;
            dropped by :meth:`~ParamBinding.unbind`) instead of a fresh one per bucket: faster when called
            repeatedly, at the cost of keeping that memory between calls.

    Yields:
        ``(name, tensor)`` in the order of the first rank's parameters (then those it lacks, rank by rank), under
        the names of the unwrapped single-rank model (what a TP=PP=EP=1 build calls them: ``decoder.layers.<i>``
        with the global layer index, ``local_experts.<e>`` with the global expert index), dtype and device of the
        flat buffers.

    Raises:
        BindingError: the binding was unbound, ``bucket_bytes`` < 1, ``dst`` is no member of ``group``, a
            rank has unbound parameters (the full model would miss them), a rank's manifest is version 1, a
            grouped-GEMM expert tensor (several experts in one parameter), or the manifests disagree (raised on
            every rank before anything moves).
    """
    import torch.distributed as dist

    own = binding.flat_buffers()
    if bucket_bytes < 1:
        raise BindingError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    group = group if group is not None else _default_group()
    size, me = dist.get_world_size(group), dist.get_rank(group)
    if dst is not None and not 0 <= dst < size:
        raise BindingError(f"dst={dst} is not a rank of the group (size {size})")
    buckets = _planned(binding, group, bucket_bytes)
    if own:
        device = own[0].device
    elif dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    ranks = dist.get_process_group_ranks(group)
    receive = dst is None or dst == me
    for b in buckets:
        staging = _staging(binding, b, device, reuse_buffers) if receive else None
        for src in b.sources:
            mine = own[src.buffer][src.lo:src.hi] if src.rank == me else None
            into = staging[src.at:src.at + src.hi - src.lo] if staging is not None else None
            if dst is None:
                moved = mine if mine is not None else into
                assert moved is not None  # every member receives
                dist.broadcast(moved, src=ranks[src.rank], group=group)
            elif src.rank != dst:
                if mine is not None:
                    dist.send(mine, dst=ranks[dst], group=group)
                elif into is not None:
                    dist.recv(into, src=ranks[src.rank], group=group)
            if mine is not None and into is not None:
                into.copy_(mine)
        if staging is None:
            continue
        out = _assemble(b, staging)  # fresh and contiguous: a view is one as_strided at the planned offset
        for name, offset, shape, strides in b.outputs:
            yield name, out.as_strided(shape, strides, offset)
        del out, staging


def gather_full(binding: ParamBinding, *, dst: int | None = None, group: Any = None,
                bucket_bytes: int = DEFAULT_BUCKET_BYTES, reuse_buffers: bool = False) -> dict[str, torch.Tensor]:
    """Every full, unsharded tensor of the model under the unwrapped single-rank model's names.

    Collective over ``group`` (default: the world; all of the model's TP x PP x EP and DP ranks). Moves flat
    buffer slices (one collective per flat buffer per bucket), concatenating TP shards on the receiving side from
    the manifests (format 2); see :func:`iter_full` for the order, names and errors.

    Args:
        binding: this rank's binding (:func:`~mcore_compat.binding.bind_params`).
        dst: group rank that receives; ``None``: every rank receives.
        group: the process group holding the model (default: the world).
        bucket_bytes: bound on the staging memory (and on the bytes per collective).
        reuse_buffers: keep the receive tensor on the binding for the next call (see :func:`iter_full`).

    Returns:
        ``{name: full tensor}`` on receiving ranks, ``{}`` on the others (views of one tensor per bucket).
    """
    return dict(iter_full(binding, bucket_bytes=bucket_bytes, dst=dst, group=group, reuse_buffers=reuse_buffers))
