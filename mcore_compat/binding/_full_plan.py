"""The first step of :mod:`.full`'s transfer: the tensors of the single-rank model (:class:`_Full`) and the
pieces each needs from which group rank, planned from every rank's manifest; inconsistent manifests refused."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import BindingError
from .manifest import Manifest, ManifestEntry
from .views import dtype_from_name, numel


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
