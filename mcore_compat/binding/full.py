"""Full, unsharded weights from any TP x PP x EP (+ virtual pipeline) layout, moved as flat-buffer slices.

:func:`iter_full` and :func:`gather_full` give the tensors of the model a single rank would build with the same
config (TP = PP = EP = 1), under its names. Every rank's :class:`~.manifest.Manifest` (format 2: single-rank
name, TP partition dim and stride, expert index, tied pair per parameter) is exchanged once; from them every rank
plans the same transfer:

1. each full tensor needs one piece per TP rank (one piece when it is duplicated over TP); the first rank of the
   group holding a piece sends it (DP and expert-DP replicas send nothing; a tied output-layer copy is skipped:
   the input embedding stands for it);
2. full tensors are taken in order into buckets of at most ``bucket_bytes`` (output bytes, and bytes of the
   slices received into staging); for each bucket each source rank sends, per flat buffer, the one contiguous
   slice that holds its pieces (one collective per flat buffer slice: a ``broadcast`` over the group, or
   ``send``/``recv`` to ``dst``), except that a piece of a large tensor (``_BLOCK_COPY_NUMEL`` elements or more)
   that is one block of its full tensor (duplicated over TP, or split along dim 0 with stride 1) is sent on its
   own, straight into its place in the output (the slices are then the runs of pieces between such pieces). All
   collectives of a bucket are started before any is waited for (they overlap; gloo runs them on its worker
   threads) and the output views are made meanwhile;
3. the receiver puts every other element in its place by one ``index_select`` of rows per row width (the
   index, planned once with :func:`~.placement.place_shard` on element positions, is the TP concatenation along
   ``partition_dim``, stride-interleaved; each small tensor is copied in rows as wide as its contiguous runs
   allow: a whole dim-0 TP piece, a row of a dim-1 one) and block copies for the pieces of large tensors that
   are not one block, then frees the received slices.

Peak memory beyond the output: one bucket of received slices (at most ``bucket_bytes``, or one tensor's shards
when they are larger); with ``reuse_output=True`` the output tensors are kept and refilled by the next call.
Inconsistent manifests (a tensor's TP shards disagreeing on dim, stride or size; an expert claimed by two EP
ranks; one name on two pipeline stages; a missing shard) are refused before anything moves.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Final

import torch

from .._util.gc import gc_paused
from .._util.own_math import own_tensor_math
from ._full_plan import _Full, plan
from .errors import BindingError
from .gather import collective_device
from .manifest import ManifestEntry
from .param_binding import ParamBinding
from .placement import place_shard
from .views import contiguous_strides, dtype_from_name, numel

__all__ = ["DEFAULT_BUCKET_BYTES", "gather_full", "iter_full"]

#: Default bucket size of :func:`gather_full` (bytes): large enough that a small model moves one slice per flat
#: buffer, small enough to bound the staging memory of a large one.
DEFAULT_BUCKET_BYTES: Final = 512 * 2**20


@dataclass
class _Source:
    """One slice sent for a bucket: ``flat_buffers()[buffer][lo:hi]`` of group rank ``rank``, received at
    ``at`` of the bucket's staging tensor."""

    rank: int
    buffer: int
    lo: int
    hi: int
    at: int


#: A source slice is received at a staging offset congruent to its flat-buffer offset modulo the bucket's
#: alignment (the largest power of two, up to this many elements, dividing the offsets and sizes of its pieces), so
#: the alignment of the parameters in the flat buffers carries over to the staging tensor and the TP
#: concatenation can copy rows of many elements instead of single elements (see :class:`_Rows`).
_MAX_ALIGN: Final = 1024


def _pow2_dividing(n: int, cap: int) -> int:
    """The largest power of two dividing ``n`` (``cap`` for 0), at most ``cap`` (a power of two)."""
    return cap if n == 0 else min(n & -n, cap)


def _staging_layout(spans: list[tuple[int, int, int, int]], align: int) -> tuple[list[_Source], int]:
    """The slices sent for a bucket (``spans``: ``(rank, buffer, lo, hi)``), each at a staging offset ``at``
    congruent to ``lo`` modulo ``align``, in (rank, buffer, lo) order; and the staging size."""
    sources, at = [], 0
    for rank, buffer, lo, hi in sorted(spans):
        at += (lo - at) % align
        sources.append(_Source(rank, buffer, lo, hi, at))
        at += hi - lo
    return sources, at


def _buckets(fulls: list[_Full], bucket_bytes: int) -> Iterator[list[_Full]]:
    """Consecutive tensors of one dtype whose output bytes, and the bytes of the staging tensor receiving the
    slices sent for them (alignment padding included), each stay within ``bucket_bytes`` (at least one tensor
    per bucket)."""
    bucket: list[_Full] = []
    spans: dict[tuple[int, int], tuple[int, int]] = {}
    size, align = 0, _MAX_ALIGN

    def grown(full: _Full) -> tuple[dict[tuple[int, int], tuple[int, int]], int]:
        new, a = dict(spans), align
        for rank, e in full.pieces.values():
            lo, hi = new.get((rank, e.buffer), (e.offset, e.offset + e.numel))
            new[(rank, e.buffer)] = (min(lo, e.offset), max(hi, e.offset + e.numel))
            a = _pow2_dividing(e.offset | e.numel, a)
        return new, a

    for full in fulls:
        new, a = grown(full)
        item = dtype_from_name(full.first.dtype).itemsize
        staged = _staging_layout([(*k, *v) for k, v in new.items()], a)[1]
        too_big = size + full.nbytes > bucket_bytes or staged * item > bucket_bytes
        if bucket and (too_big or full.first.dtype != bucket[0].first.dtype):
            yield bucket
            bucket, spans, size, align = [], {}, 0, _MAX_ALIGN
            new, a = grown(full)
        bucket.append(full)
        spans, size, align = new, size + full.nbytes, a
    if bucket:
        yield bucket


#: Tensors of at least this many elements are put in place by block copies; smaller ones by row copies.
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
class _Rows:
    """Small tensors put in place by one ``index_select`` of rows: output ``[out:out + numel]`` viewed as rows of
    ``width`` elements is ``staging[shift:]`` viewed as rows of ``width``, rows ``index``. Every contiguous run
    of a tensor's elements (a TP piece, or a row of one) starts and ends on a row boundary of both, so a row
    copy moves exactly the elements an element-wise ``index_select`` would."""

    width: int
    shift: int
    out: int
    numel: int
    index: torch.Tensor
    on_device: dict[torch.device, torch.Tensor] = field(default_factory=dict)

    def index_on(self, device: torch.device) -> torch.Tensor:
        if device not in self.on_device:
            self.on_device[device] = self.index.to(device)
        return self.on_device[device]


@dataclass
class _Bucket:
    """One bucket's transfer, planned once: the slices to move, then the TP concatenation as one ``index_select``
    of rows per row width (``rows``, the small tensors, packed first in the output) and block copies for the
    large tensors (``copies``); then the outputs as views made in groups of equal shape (``groups``:
    ``(offset, count, shape)``, giving the tensors of ``layout``; ``order``: the position in that list of each
    tensor of ``outputs``)."""

    dtype: torch.dtype
    sources: list[_Source]
    staging: int
    total: int
    rows: list[_Rows]
    copies: list[_Copy]
    outputs: list[tuple[str, int, tuple[int, ...], tuple[int, ...]]]  # name, offset, shape, strides
    groups: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)
    order: list[int] = field(default_factory=list)
    #: pieces received straight into the output (``at``: offset in the output tensor), after ``sources``.
    directs: list[_Source] = field(default_factory=list)
    #: ``reuse_output``: the output tensor and its views (in output order) per device, kept for the next call.
    kept: dict[torch.device, tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=dict)

    @cached_property
    def names(self) -> list[str]:
        """The names of the full tensors, in output order."""
        return [name for name, _, _, _ in self.outputs]


def _gcd_with(values: torch.Tensor, g: int) -> int:
    """``gcd(g, *values)`` (``values``: an integer tensor), vectorised: the ``gcd(g, v)`` are divisors of ``g``,
    so few distinct ones remain to reduce in Python."""
    if g == 1 or values.numel() == 0:
        return g
    for d in torch.unique(torch.gcd(values, torch.full_like(values, g))).tolist():
        g = math.gcd(g, int(d))
    return g


def _row_width(positions: torch.Tensor) -> tuple[int, int]:
    """``(width, shift)`` of the widest rows one small tensor can be copied by: ``positions[i]`` is the staging
    position of its output element ``i``; every run of consecutive positions must start at an output position
    divisible by ``width`` and at a staging position congruent to ``shift`` modulo ``width``."""
    n = positions.numel()
    if n == 0:
        return 1, 0
    starts = torch.nonzero(positions[1:] - positions[:-1] != 1).flatten() + 1
    g = _gcd_with(starts, n)
    g = _gcd_with(positions[starts] - positions[0], g)
    return g, int(positions[0]) % g


def _contiguous_at(e: ManifestEntry, piece: int) -> int | None:
    """Where TP piece ``piece`` (held as ``e``) starts in its full tensor when it is one contiguous block of it (a
    tensor duplicated over TP, or split along its first dimension of more than one element with stride 1); else
    ``None``."""
    if not e.tp_split:
        return 0
    if e.partition_stride == 1 and all(n == 1 for n in e.shape[:e.partition_dim]):
        return piece * e.numel
    return None


def _plan_bucket(bucket: list[_Full]) -> _Bucket:
    # the pieces of large tensors that are one block of their full tensor are received straight into the output;
    # the others travel in slices (per source flat buffer, the runs of them between direct pieces) into staging
    direct: dict[tuple[int, int, int], int] = {}  # (rank, buffer, offset) -> where in its full tensor
    held: dict[tuple[int, int], list[tuple[int, int]]] = {}
    align = _MAX_ALIGN
    for f in bucket:
        for piece, (rank, e) in f.pieces.items():
            within = _contiguous_at(e, piece) if numel(f.shape) >= _BLOCK_COPY_NUMEL else None
            if within is not None:
                direct[(rank, e.buffer, e.offset)] = within
            held.setdefault((rank, e.buffer), []).append((e.offset, e.offset + e.numel))
            align = _pow2_dividing(e.offset | e.numel, align)
    spans: list[tuple[int, int, int, int]] = []  # rank, buffer, lo, hi
    for (rank, buffer), items in sorted(held.items()):
        run: list[int] | None = None
        for lo, hi in sorted(items):
            if (rank, buffer, lo) in direct:
                if run is not None:
                    spans.append((rank, buffer, run[0], run[1]))
                run = None
            else:
                run = [lo, hi] if run is None else [run[0], max(run[1], hi)]
        if run is not None:
            spans.append((rank, buffer, run[0], run[1]))
    sources, at = _staging_layout(spans, align)
    starts: dict[tuple[int, int], list[_Source]] = {}
    for src in sources:  # in lo order per (rank, buffer)
        starts.setdefault((src.rank, src.buffer), []).append(src)
    los = {k: [x.lo for x in v] for k, v in starts.items()}

    def staged(rank: int, e: ManifestEntry) -> int:
        """Staging position of the piece held as ``e`` by group rank ``rank``."""
        src = starts[(rank, e.buffer)][bisect.bisect_right(los[(rank, e.buffer)], e.offset) - 1]
        return src.at + e.offset - src.lo

    # small tensors: element positions, then grouped by row width (and, within a group, by shape)
    by_rows: dict[tuple[int, int], list[tuple[_Full, torch.Tensor]]] = {}
    for f in bucket:
        if numel(f.shape) >= _BLOCK_COPY_NUMEL:
            continue
        target = torch.empty(f.shape, dtype=torch.long)
        for piece, (rank, e) in f.pieces.items():
            start = staged(rank, e)
            positions = torch.arange(start, start + e.numel, dtype=torch.long).view(e.shape)
            if e.tp_split:
                place_shard(target, positions, e.partition_dim, e.partition_stride, piece, e.tp_size)
            else:
                target.copy_(positions)
        flat = target.reshape(-1)
        by_rows.setdefault(_row_width(flat), []).append((f, flat))
    where: dict[str, int] = {}
    layout: list[tuple[str, int, tuple[int, ...]]] = []
    rows, o = [], 0
    for (width, shift), members in sorted(by_rows.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        members.sort(key=lambda m: (len(m[0].shape), m[0].shape))
        first = o
        for f, _ in members:
            where[f.name] = o
            layout.append((f.name, o, f.shape))
            o += numel(f.shape)
        index = torch.cat([flat for _, flat in members])[::width]
        rows.append(_Rows(width, shift, first, o - first, torch.div(index - shift, width, rounding_mode="floor")))
    copies, directs = [], []
    for f in bucket:
        if f.name in where:
            continue
        where[f.name] = o
        layout.append((f.name, o, f.shape))
        for piece, (rank, e) in f.pieces.items():
            within = direct.get((rank, e.buffer, e.offset))
            if within is not None:
                directs.append(_Source(rank, e.buffer, e.offset, e.offset + e.numel, o + within))
            else:
                copies.append(_Copy(o, f.shape, staged(rank, e), e.shape, e.partition_dim if e.tp_split else -1,
                                    e.partition_stride, piece, e.tp_size))
        o += numel(f.shape)
    groups: list[tuple[int, int, tuple[int, ...]]] = []
    for _, offset, shape in layout:
        if groups and groups[-1][2] == shape and groups[-1][0] + groups[-1][1] * numel(shape) == offset:
            groups[-1] = (groups[-1][0], groups[-1][1] + 1, shape)
        else:
            groups.append((offset, 1, shape))
    position = {name: i for i, (name, _, _) in enumerate(layout)}
    outputs = [(f.name, where[f.name], f.shape, contiguous_strides(f.shape)) for f in bucket]
    return _Bucket(dtype_from_name(bucket[0].first.dtype), sources, at, o, rows, copies, outputs, groups,
                   [position[f.name] for f in bucket], sorted(directs, key=lambda d: (d.rank, d.buffer, d.lo)))


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


@own_tensor_math
def _start(b: _Bucket, own: list[torch.Tensor], staging: torch.Tensor | None, out: torch.Tensor | None, me: int,
           dst: int | None, ranks: list[int], group: Any) -> list[Any]:
    """Start moving bucket ``b``'s slices into ``staging`` and its direct pieces into ``out`` (both ``None`` on
    ranks that only send); returns the works to wait for. Every collective of the bucket is started before any is
    waited for, so they overlap each other (gloo runs them on its worker threads) and the making of the output
    views (:func:`_views`)."""
    import torch.distributed as dist

    works = []
    for src, target in [(s, staging) for s in b.sources] + [(d, out) for d in b.directs]:
        mine = own[src.buffer][src.lo:src.hi] if src.rank == me else None
        into = target[src.at:src.at + src.hi - src.lo] if target is not None else None
        work = None
        if dst is None:
            moved = mine if mine is not None else into
            assert moved is not None  # every member receives
            work = dist.broadcast(moved, src=ranks[src.rank], group=group, async_op=True)
        elif src.rank != dst:
            if mine is not None:
                work = dist.isend(mine, dst=ranks[dst], group=group)
            elif into is not None:
                work = dist.irecv(into, src=ranks[src.rank], group=group)
        if work is not None:
            works.append(work)
        if mine is not None and into is not None:
            into.copy_(mine)
    return works


@own_tensor_math
def _views(b: _Bucket, out: torch.Tensor) -> list[torch.Tensor]:
    """The views of bucket ``b``'s output tensor ``out``, one per full tensor, in output order (names:
    ``b.names``), one ``unbind`` per run of equal shapes (with the garbage collector paused:
    :func:`~mcore_compat._util.gc.gc_paused`)."""
    with gc_paused():
        views: list[torch.Tensor] = []
        for offset, count, shape in b.groups:
            if count == 1:
                views.append(out.as_strided(shape, contiguous_strides(shape), offset))
            else:
                views.extend(out[offset:offset + count * numel(shape)].view(count, *shape).unbind(0))
        return [views[i] for i in b.order]


@own_tensor_math
def _assemble(b: _Bucket, staging: torch.Tensor, out: torch.Tensor, works: list[Any]) -> None:
    """Wait for the bucket's slices, then put every element of ``out`` in place: the small tensors by one row
    ``index_select`` per row width, the large ones by block copies."""
    for work in works:
        work.wait()
    for r in b.rows:
        n_rows = (staging.numel() - r.shift) // r.width
        source = staging[r.shift:r.shift + n_rows * r.width].view(n_rows, r.width)
        torch.index_select(source, 0, r.index_on(staging.device), out=out[r.out:r.out + r.numel].view(-1, r.width))
    for c in b.copies:
        shard = staging[c.at:c.at + numel(c.shape)].view(c.shape)
        full = out[c.out:c.out + numel(c.full)].view(c.full)
        if c.dim < 0:
            full.copy_(shard)
        else:
            place_shard(full, shard, c.dim, c.stride, c.piece, c.tp)


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


def _gather(binding: ParamBinding, bucket_bytes: int, dst: int | None, group: Any, reuse_buffers: bool,
            reuse_output: bool) -> Iterator[tuple[list[str], list[torch.Tensor]]]:
    """:func:`iter_full`'s work: per bucket, the names and the full tensors, in output order."""
    import torch.distributed as dist

    own = binding.flat_buffers()
    if bucket_bytes < 1:
        raise BindingError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    group = group if group is not None else _default_group()
    size, me = dist.get_world_size(group), dist.get_rank(group)
    if dst is not None and not 0 <= dst < size:
        raise BindingError(f"dst={dst} is not a rank of the group (size {size})")
    buckets = _planned(binding, group, bucket_bytes)
    device = collective_device(group, own)
    ranks = dist.get_process_group_ranks(group)
    receive = dst is None or dst == me
    for b in buckets:
        staging = _staging(binding, b, device, reuse_buffers) if receive else None
        if staging is None:
            for work in _start(b, own, None, None, me, dst, ranks, group):
                work.wait()
            continue
        kept = b.kept.get(device) if reuse_output else None
        if kept is not None:  # the tensors of the previous call, overwritten
            out, views = kept
            works = _start(b, own, staging, out, me, dst, ranks, group)
        else:  # views of one new tensor (never of staging), made while the data moves
            out = torch.empty(b.total, dtype=b.dtype, device=device)
            works = _start(b, own, staging, out, me, dst, ranks, group)
            views = _views(b, out)
            if reuse_output:
                b.kept[device] = (out, views)
        _assemble(b, staging, out, works)
        yield b.names, views
        del out, views, staging


def iter_full(binding: ParamBinding, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dst: int | None = None,
              group: Any = None, reuse_buffers: bool = False,
              reuse_output: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(single-rank name, full tensor)`` bucket by bucket; every member of ``group`` must exhaust it.

    Collective: each bucket is a round of collectives that every member of ``group`` takes part in, so every rank
    iterates to the end (ranks other than ``dst`` yield nothing). The tensors of one bucket are views of one new
    tensor (never of the flat buffers; with ``reuse_output``, of the one kept from the previous call); dropping a
    bucket's tensors once an engine has loaded them bounds the memory to one bucket of output plus one bucket of
    received slices. The first call plans the transfer (one
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
        reuse_output: fill the output tensors of the previous call (kept on the binding with the transfer plan,
            one set per device; dropped by :meth:`~ParamBinding.unbind`) instead of new ones, and yield those same
            tensor objects again: **each call overwrites what the previous one yielded**, so copy what must
            outlive the next call (an engine that loads the weights at once does). Saves allocating, faulting in
            and viewing the whole model on every call (most of the cost for many small tensors), at the cost of
            keeping one output of the whole model on every receiving rank between calls.

    Pickling one of these views writes the whole bucket it views (see :func:`gather_full`): clone a tensor
    before a transport that pickles it.

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
    for names, tensors in _gather(binding, bucket_bytes, dst, group, reuse_buffers, reuse_output):
        yield from zip(names, tensors, strict=True)


def gather_full(binding: ParamBinding, *, dst: int | None = None, group: Any = None,
                bucket_bytes: int = DEFAULT_BUCKET_BYTES, reuse_buffers: bool = False,
                reuse_output: bool = False) -> dict[str, torch.Tensor]:
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
        reuse_output: return the same output tensors on every call, overwritten (see :func:`iter_full`).

    Returns:
        ``{name: full tensor}`` on receiving ranks, ``{}`` on the others (views of one tensor per bucket).

    Pickling a view writes its whole storage (``pickle``, Ray's object store, ``multiprocessing`` queues): hand
    ``t.clone()`` of each tensor to such a transport, or the bucket's tensors would each carry the whole bucket
    (measured: 53 tensors of a 20 MiB model through Ray, 12 s instead of 0.15 s; examples/ray_rl clones).
    """
    full: dict[str, torch.Tensor] = {}
    with gc_paused():  # the dict too (see gc_paused)
        for names, tensors in _gather(binding, bucket_bytes, dst, group, reuse_buffers, reuse_output):
            full.update(zip(names, tensors, strict=True))
    return full
