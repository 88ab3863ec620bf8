"""Where each parameter of a model chunk sits in the full, unsharded single-rank model, from Megatron's attributes.

A parameter of a TP x PP x EP (+ virtual pipeline) model is a piece of one tensor of the model a single rank
would build with the same config (TP = PP = EP = 1). :func:`placements` reads, per parameter of one unwrapped
chunk, what is needed to put it back:

* the single-rank name: a transformer layer's local index replaced by its global ``layer_number - 1``
  (Megatron's ``TransformerLayer.layer_number`` counts pipeline and virtual-stage offsets, 1-based), a local
  expert's index replaced by its global index (``local_expert_indices`` of the MoE layer: ``SwitchMLP`` 0.4,
  ``MoELayer`` 0.5+, for ``SequentialMLP``'s ``local_experts``; ``TEGroupedMLP``'s ``weight<i>``/``bias<i>``
  shifted by the EP rank's first expert);
* tensor parallelism: ``tensor_model_parallel``, ``partition_dim`` and ``partition_stride``
  (tensor_parallel/layers.py ``set_tensor_model_parallel_attributes``, every release; a layer built with
  ``perform_initialization=False`` leaves its weight unmarked, and its ``*_per_partition`` size tells); a gated MLP's
  ``linear_fc1`` (``config.gated_linear_unit``) holds ``[gate shard; up shard]`` per TP rank, i.e. stride 2,
  although releases before 0.16 give it ``partition_stride=1`` (transformer/mlp.py sets ``fc1_stride = 2``
  from 0.16);
* the tied output layer: the last pipeline stage's ``output_layer.weight`` when the model shares it with the
  input embedding (``share_embeddings_and_output_weights`` and no ``pre_process``) stands for
  ``embedding.word_embeddings.weight`` (the single-rank model has no ``output_layer.weight`` then).

:func:`unshard`, :func:`shard` and :func:`place_shard` move between TP shards and full tensors; the self-check's
independent float64 reference and :func:`~mcore_compat.binding.gather_full` both use them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Coordinates", "Placement", "coordinates", "place_shard", "placements", "shard", "single_rank_names", "tp_attrs", "unshard"]

_EMBEDDING = "embedding.word_embeddings.weight"


@dataclass(frozen=True)
class Placement:
    """Where one parameter of a chunk sits in the single-rank model.

    Attributes:
        full_name: its name in the unwrapped single-rank model (layer and expert numbers global).
        tp_split: Megatron's ``tensor_model_parallel`` (False: duplicated over the TP ranks).
        partition_dim: the dimension split over TP (``-1`` when not split).
        partition_stride: TP pieces are interleaved with this stride (1: one contiguous piece per rank).
        expert: the global expert index of an expert's parameter (``None`` for dense parameters; ``-1`` for an
            expert-parallel parameter holding several experts at once, as the legacy ``GroupedMLP``'s
            ``weight1``/``weight2``, which :func:`~mcore_compat.binding.gather_full` refuses).
        tied_to: the single-rank name this parameter is a tied copy of (the last stage's output layer of a model
            sharing it with the input embedding), else ``None``.
    """

    full_name: str
    tp_split: bool
    partition_dim: int
    partition_stride: int
    expert: int | None = None
    tied_to: str | None = None


def tp_attrs(p: Any) -> tuple[bool, int, int]:
    """``(tensor_model_parallel, partition_dim, partition_stride)`` as Megatron set them on ``p``."""
    split = bool(getattr(p, "tensor_model_parallel", False))
    return split, int(getattr(p, "partition_dim", -1)) if split else -1, int(getattr(p, "partition_stride", 1))


def unshard(shards: Sequence[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """The full tensor of tensor-parallel ``shards`` (rank order): rank r holds pieces r, r+tp, ... of the full
    tensor cut into tp*stride pieces along ``dim`` (tensor_parallel/layers.py ``_initialize_affine_weight_cpu``)."""
    pieces = [s.chunk(stride, dim) for s in shards]
    return torch.cat([pieces[r][j] for j in range(stride) for r in range(len(shards))], dim)


def shard(full: torch.Tensor, dim: int, stride: int, rank: int, tp: int) -> torch.Tensor:
    """TP rank ``rank``'s shard of ``full`` (inverse of :func:`unshard`)."""
    pieces = full.chunk(tp * stride, dim)
    return torch.cat([pieces[j * tp + rank] for j in range(stride)], dim)


def place_shard(full: torch.Tensor, piece: torch.Tensor, dim: int, stride: int, rank: int, tp: int) -> None:
    """Copy TP rank ``rank``'s shard ``piece`` into its places of ``full`` (in place; :func:`unshard` piecewise)."""
    size = piece.shape[dim] // stride
    for j in range(stride):
        full.narrow(dim, (j * tp + rank) * size, size).copy_(piece.narrow(dim, j * size, size))


def _expert_offsets(core: Any) -> dict[str, list[int]]:
    """``{module name: global expert indices}`` of each module holding local experts (``local_experts`` list or
    grouped ``weight<i>`` GEMMs), read from the MoE layer's ``local_expert_indices``."""
    modules = dict(core.named_modules())
    out: dict[str, list[int]] = {}
    for name, m in modules.items():
        local = getattr(m, "local_experts", None)
        grouped = getattr(m, "num_local_experts", None) if local is None and hasattr(m, "linear_fc1") else None
        if local is None and not (isinstance(grouped, int) and hasattr(m.linear_fc1, "weight0")):
            continue
        n = len(local) if local is not None else int(grouped)  # type: ignore[arg-type]
        parent = modules.get(name.rpartition(".")[0]) if name else None
        indices = getattr(m, "local_expert_indices", None) or getattr(parent, "local_expert_indices", None)
        if indices is None:
            from .. import symbols

            first = symbols.resolve("parallel_state").get_expert_model_parallel_rank() * n
            indices = [first + i for i in range(n)]
        out[name] = [int(i) for i in indices]
    return out


def _gated_fc1(core: Any) -> set[int]:
    """ids of the params of gated MLPs' ``linear_fc1`` (stride 2 over TP, see the module docstring)."""
    out: set[int] = set()
    for m in core.modules():
        fc1 = getattr(m, "linear_fc1", None)
        if fc1 is not None and getattr(getattr(m, "config", None), "gated_linear_unit", False):
            out.update(id(p) for p in fc1.parameters(recurse=False))
    return out


#: (full size, per-partition size, partition dim) attributes of Megatron's tensor-parallel layers
#: (tensor_parallel/layers.py, every release: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding).
_PARTITIONED_LAYERS = (("output_size", "output_size_per_partition", 0), ("input_size", "input_size_per_partition", 1),
                       ("num_embeddings", "num_embeddings_per_partition", 0))


def _unmarked_shards(core: Any) -> dict[int, int]:
    """``{id(weight): partition dim}`` of tensor-parallel layers whose weight lacks ``tensor_model_parallel``.

    Megatron sets the attribute inside its weight initialisation, which ``config.perform_initialization=False``
    skips (tensor_parallel/layers.py, every release; the bias is marked either way): such a weight is still a
    shard, as the layer's ``*_per_partition`` size says.
    """
    out: dict[int, int] = {}
    for m in core.modules():
        w = m._parameters.get("weight")
        if w is None or getattr(w, "tensor_model_parallel", False):
            continue
        for full, part, dim in _PARTITIONED_LAYERS:
            size = getattr(m, part, None)
            if isinstance(size, int) and getattr(m, full, size) != size:
                out[id(w)] = dim
                break
    return out


def placements(core: Any) -> dict[str, Placement]:
    """``{name in core.named_parameters(): Placement}`` for one unwrapped model chunk (see the module docstring).

    Raises:
        ValueError: a local expert index beyond the MoE layer's ``local_expert_indices``.
    """
    layers = getattr(getattr(core, "decoder", None), "layers", None)
    tied = bool(getattr(core, "share_embeddings_and_output_weights", False))
    output = getattr(getattr(core, "output_layer", None), "weight", None)
    experts = _expert_offsets(core)
    gated = _gated_fc1(core)
    unmarked = _unmarked_shards(core)
    out: dict[str, Placement] = {}
    for name, p in core.named_parameters():
        parts = name.split(".")
        if layers is not None and parts[:2] == ["decoder", "layers"]:
            parts[2] = str(int(layers[int(parts[2])].layer_number) - 1)
        expert = None
        owner = max((m for m in experts if not m or name.startswith(m + ".")), key=len, default=None)
        if owner is not None:
            at = len(owner.split(".")) if owner else 0
            rest = parts[at:]
            if rest[:1] == ["local_experts"] and len(rest) > 2:
                expert = experts[owner][int(rest[1])]
                parts[at + 1] = str(expert)
            elif len(rest) == 2 and rest[1][-1:].isdigit() and rest[1].rstrip("0123456789") in ("weight", "bias"):
                kind = rest[1].rstrip("0123456789")
                expert = experts[owner][int(rest[1][len(kind):])]
                parts[-1] = f"{kind}{expert}"
        if expert is None and getattr(p, "allreduce", True) is False:
            expert = -1  # expert-parallel (allreduce=False, tensor_parallel/layers.py) but no single expert
        split, dim, stride = tp_attrs(p)
        if not split and id(p) in unmarked:
            split, dim, stride = True, unmarked[id(p)], 1
        if split and stride == 1 and id(p) in gated:
            stride = 2
        full = ".".join(parts)
        tied_to = _EMBEDDING if tied and p is output and not getattr(core, "pre_process", True) else None
        out[name] = Placement(full, split, dim, stride, expert, tied_to)
    return out


def single_rank_names(core: Any, *, layer_base: int = 0) -> dict[Any, str]:
    """``{param: single-rank name}`` of one unwrapped chunk; a tied output-layer copy is named as the word
    embedding it stands for; ``layer_base=1`` numbers layers by Megatron's 1-based ``layer_number``."""
    places = placements(core)
    out = {}
    for name, p in core.named_parameters():
        pl = places[name]
        full = pl.tied_to or pl.full_name
        if layer_base and full.startswith("decoder.layers."):
            parts = full.split(".")
            parts[2] = str(int(parts[2]) + layer_base)
            full = ".".join(parts)
        out[p] = full
    return out


@dataclass(frozen=True)
class Coordinates:
    """This rank's place in the parallel layout, as ``parallel_state`` says (all 0 / 1 when not initialised).

    ``etp_rank``/``etp_size``: the expert tensor-parallel rank and size (0.11+ ``get_expert_tensor_parallel_*``;
    the TP rank and size before, where experts were split over the TP group).
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    ep_rank: int = 0
    etp_rank: int = 0
    etp_size: int = 1


def coordinates() -> Coordinates:
    """This rank's :class:`Coordinates` (defaults when model parallelism is not initialised)."""
    from .._util.rank_coords import read

    c = read()  # the one reader of parallel_state (checkpoint.coords reads it too)
    return Coordinates(c["tp"], c["tp_size"], c["pp"], c["ep"], c["etp"], c["etp_size"])
