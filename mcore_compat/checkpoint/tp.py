"""Tensor-parallel resharding of a checkpoint: how each parameter is split over TP, recorded at save and used to
cut the saved shards into the loading job's shards.

The split of a parameter is Megatron's own: ``tensor_model_parallel``, ``partition_dim`` and ``partition_stride``
(megatron/core/tensor_parallel/layers.py ``set_tensor_model_parallel_attributes``; a param without
``tensor_model_parallel`` is duplicated over TP), read by :func:`mcore_compat.binding.placement.placements` (which
also knows a gated MLP's ``linear_fc1`` stride and weights left unmarked by ``perform_initialization=False``); the
full tensor of TP shards and a TP rank's shard of a full tensor are :func:`~mcore_compat.binding.placement.unshard`
and :func:`~mcore_compat.binding.placement.shard`, the functions :func:`mcore_compat.gather_full` uses. Names are
never read to decide a split.

The manifest records, per pipeline stage, ``{"<chunk>.<param name>": [partition dim, stride]}`` (dim ``-1``:
duplicated over TP). A TP change is refused, before anything is loaded, for a checkpoint without that record
(written before it existed), for expert params, for a param whose split differs between the checkpoint and the
model, for shapes that do not tile (e.g. a vocabulary padded to another multiple of
``make_vocab_size_divisible_by`` x TP), and for a non-parameter tensor whose TP copies differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..binding.placement import placements, shard, unshard
from ..layout.read import unwrap
from .coords import is_expert
from .errors import CheckpointReshardError

__all__ = ["DUPLICATED", "Split", "reshard", "same_copies", "split_record", "splits"]

#: The partition dim recorded for a param duplicated over TP.
DUPLICATED = -1


@dataclass(frozen=True)
class Split:
    """How one tensor is laid out over TP: ``dim`` split (``-1``: duplicated) with Megatron's ``stride``."""

    dim: int = DUPLICATED
    stride: int = 1

    @property
    def duplicated(self) -> bool:
        return self.dim < 0

    def text(self) -> str:
        return "duplicated over TP" if self.duplicated else f"split on dim {self.dim} (stride {self.stride})"


def splits(chunks: list[Any]) -> dict[str, Split]:
    """``{"<chunk>.<param name>": Split}`` of every parameter of the chunks (see the module docstring); an expert
    param (``allreduce=False``) is left out: its TP layout is not resharded."""
    out: dict[str, Split] = {}
    for i, chunk in enumerate(chunks):
        core = unwrap(chunk)
        places = placements(core)
        for name, p in core.named_parameters():
            if is_expert(p):
                continue
            pl = places[name]
            out[f"{i}.{name}"] = Split(pl.partition_dim, pl.partition_stride) if pl.tp_split else Split()
    return out


def split_record(chunks: list[Any]) -> dict[str, list[int]]:
    """:func:`splits` as the manifest stores it: ``{"<chunk>.<param name>": [dim, stride]}``."""
    return {k: [s.dim, s.stride] for k, s in splits(chunks).items()}


def _full(name: str, pieces: Sequence[torch.Tensor], src: Split, hint: str) -> torch.Tensor:
    """The whole tensor from the checkpoint's TP shards (rank order)."""
    if len(pieces) == 1 or src.duplicated:
        return pieces[0]
    if any(p.shape != pieces[0].shape for p in pieces) or not 0 <= src.dim < pieces[0].dim() \
            or pieces[0].shape[src.dim] % src.stride:
        raise CheckpointReshardError(f"{name}: its TP shards {[list(p.shape) for p in pieces]} do not fit "
                                     f"partition dim {src.dim} / stride {src.stride}; {hint}")
    return unshard(list(pieces), src.dim, src.stride)


def reshard(name: str, pieces: Sequence[torch.Tensor], src: Split, dst: Split, rank: int, tp: int,
            shape: Sequence[int], hint: str) -> torch.Tensor:
    """TP rank ``rank`` of ``tp``'s piece (of ``shape``) of the tensor saved as ``pieces``, one per saved TP rank.

    ``src`` is the split recorded at save, ``dst`` the loading model's; a side at TP=1 holds the whole tensor, so
    only the other side's split matters then. ``hint`` (the way out) ends each refusal.

    Raises:
        CheckpointReshardError: the splits differ (both sides > 1), or the shapes do not tile.
    """
    if len(pieces) > 1 and tp > 1 and src != dst:
        raise CheckpointReshardError(f"{name}: {src.text()} in the checkpoint, {dst.text()} in this model; {hint}")
    full = _full(name, pieces, src, hint)
    if tp == 1 or dst.duplicated:
        out = full
    elif 0 <= dst.dim < full.dim() and full.shape[dst.dim] % (tp * dst.stride) == 0:
        out = shard(full, dst.dim, dst.stride, rank, tp)
    else:
        out = None
    if out is None or tuple(out.shape) != tuple(shape):
        raise CheckpointReshardError(
            f"{name}: the checkpoint's TP={len(pieces)} shards make a {list(full.shape)} tensor, this TP={tp} model "
            f"holds {list(shape)} of it per rank ({dst.text()}): another model size, or a vocabulary padded to "
            f"another multiple (Megatron pads it to make_vocab_size_divisible_by x TP); pad the vocabulary to the "
            f"same size at both TP sizes, or {hint}")
    return out


def same_copies(name: str, pieces: Sequence[torch.Tensor], hint: str) -> torch.Tensor:
    """The one value of a non-parameter tensor (a buffer, a layer's extra state) that every saved TP rank holds.

    Raises:
        CheckpointReshardError: the TP ranks' copies differ (per-rank state, e.g. FP8 scaling history).
    """
    first = pieces[0]
    for p in pieces[1:]:
        if p.shape != first.shape or p.dtype != first.dtype or not torch.equal(p, first):
            raise CheckpointReshardError(f"{name}: not a parameter, and its copies on the checkpoint's TP ranks "
                                         f"differ (per-rank state), so no one value fits another TP size; {hint}")
    return first
