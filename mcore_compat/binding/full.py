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
3. the receiver copies each piece into its places of the full tensor (:func:`~.placement.place_shard`:
   TP concatenation along ``partition_dim``, stride-interleaved), then frees the slice.

Peak memory beyond the output: one slice (at most ``bucket_bytes``, or one parameter's shard when that is
larger). Inconsistent manifests (a tensor's TP shards disagreeing on dim, stride or size; an expert claimed by
two EP ranks; a missing shard) are refused before anything moves.
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
from .views import dtype_from_name, numel

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
    for full in out.values():
        want = set(range(full.first.tp_size)) if full.first.tp_split else {0}
        if set(full.pieces) != want:
            raise BindingError(f"{full.name}: TP shards {sorted(full.pieces)} held, {sorted(want)} needed")
    return list(out.values())


def _buckets(fulls: list[_Full], bucket_bytes: int) -> Iterator[list[_Full]]:
    """Consecutive tensors whose output and every sent slice stay within ``bucket_bytes`` (at least one each)."""
    bucket: list[_Full] = []
    spans: dict[tuple[int, int], tuple[int, int, int]] = {}
    size = 0

    def grown(full: _Full) -> dict[tuple[int, int], tuple[int, int, int]]:
        new = dict(spans)
        for rank, e in full.pieces.values():
            lo, hi, _ = new.get((rank, e.buffer), (e.offset, e.offset + e.numel, 0))
            new[(rank, e.buffer)] = (min(lo, e.offset), max(hi, e.offset + e.numel),
                                     dtype_from_name(e.dtype).itemsize)
        return new

    for full in fulls:
        new = grown(full)
        too_big = size + full.nbytes > bucket_bytes or any((hi - lo) * item > bucket_bytes
                                                             for lo, hi, item in new.values())
        if bucket and too_big:
            yield bucket
            bucket, spans, size = [], {}, 0
            new = grown(full)
        bucket.append(full)
        spans, size = new, size + full.nbytes
    if bucket:
        yield bucket


def _default_group() -> Any:
    import torch.distributed as dist

    return dist.group.WORLD


def iter_full(binding: ParamBinding, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dst: int | None = None,
              group: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(single-rank name, full tensor)`` bucket by bucket; every member of ``group`` must exhaust it.

    Collective: each bucket is a round of collectives that every member of ``group`` takes part in, so every rank
    iterates to the end (ranks other than ``dst`` yield nothing). Each yielded tensor is new (not a view of a
    buffer) and complete; keeping only what an engine has not loaded yet bounds the memory to one bucket of
    output plus one slice in flight.

    Args:
        binding: this rank's binding (:func:`~mcore_compat.binding.bind_params`) after any training steps.
        bucket_bytes: bound on the bytes of full tensors per bucket and of each slice sent; a tensor whose own
            size (or one of whose shards) is larger travels alone.
        dst: group rank that receives (the others only send); ``None``: every member receives.
        group: the ranks holding the model, every one of its TP x PP x EP (and DP) ranks (default: the world).

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
    unbound: list[Any] = [None] * size
    dist.all_gather_object(unbound, list(binding.unbound), group=group)
    missing = sorted({n for names in unbound for n in names})
    if missing:
        raise BindingError(f"{len(missing)} parameter(s) are not bound (frozen, left out by dtype=, or expert params "
                           f"in no DDP buffer on 0.4/0.5), so gather_full would leave them out: "
                           f"{', '.join(missing[:5])}")
    fulls = plan(binding._manifests_over(group))
    if own:
        device = own[0].device
    elif dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    ranks = dist.get_process_group_ranks(group)
    receive = dst is None or dst == me
    for bucket in _buckets(fulls, bucket_bytes):
        outputs = {f.name: torch.empty(f.shape, dtype=dtype_from_name(f.first.dtype), device=device)
                   for f in bucket} if receive else {}
        by_source: dict[tuple[int, int], list[tuple[_Full, int, ManifestEntry]]] = {}
        for f in bucket:
            for piece, (rank, e) in f.pieces.items():
                by_source.setdefault((rank, e.buffer), []).append((f, piece, e))
        for (rank, buffer), pieces in sorted(by_source.items(), key=lambda kv: kv[0]):
            lo = min(e.offset for _, _, e in pieces)
            hi = max(e.offset + e.numel for _, _, e in pieces)
            if rank == me:
                data = own[buffer][lo:hi]
            elif receive:
                data = torch.empty(hi - lo, dtype=dtype_from_name(pieces[0][2].dtype), device=device)
            else:
                data = None
            if dst is None:
                assert data is not None
                dist.broadcast(data, src=ranks[rank], group=group)
            elif rank != dst and data is not None:
                if rank == me:
                    dist.send(data, dst=ranks[dst], group=group)
                else:
                    dist.recv(data, src=ranks[rank], group=group)
            if not receive or data is None:
                continue
            for f, piece, e in pieces:
                shard = data[e.offset - lo:e.offset - lo + e.numel].view(e.shape)
                if e.tp_split:
                    place_shard(outputs[f.name], shard, e.partition_dim, e.partition_stride, piece, e.tp_size)
                else:
                    outputs[f.name].copy_(shard)
            del data
        yield from outputs.items()


def gather_full(binding: ParamBinding, *, dst: int | None = None, group: Any = None,
                bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, torch.Tensor]:
    """Every full, unsharded tensor of the model under the unwrapped single-rank model's names.

    Collective over ``group`` (default: the world; all of the model's TP x PP x EP and DP ranks). Moves flat
    buffer slices (one collective per flat buffer per bucket), concatenating TP shards on the receiving side from
    the manifests (format 2); see :func:`iter_full` for the order, names and errors.

    Args:
        binding: this rank's binding (:func:`~mcore_compat.binding.bind_params`).
        dst: group rank that receives; ``None``: every rank receives.
        group: the process group holding the model (default: the world).
        bucket_bytes: bound on the staging memory (and on the bytes per collective).

    Returns:
        ``{name: full tensor}`` on receiving ranks, ``{}`` on the others.
    """
    return dict(iter_full(binding, bucket_bytes=bucket_bytes, dst=dst, group=group))
