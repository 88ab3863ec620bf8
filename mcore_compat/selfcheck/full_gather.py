"""``gather_full_matches``: :func:`~mcore_compat.binding.gather_full` against a per-tensor reference.

After the steps, at TP, PP or EP > 1, every rank gathers the full single-rank weights with ``gather_full`` (flat
buffer slices, TP concatenation from the binding's format-2 manifests) and, as the reference, exchanges every
parameter tensor on its own (``all_gather_object``) with where it sits read afresh from the model's Megatron
attributes (:func:`~mcore_compat.binding.placement.placements`: ``tensor_model_parallel``, ``partition_dim``,
``partition_stride``, ``layer_number``, ``local_expert_indices``), joined by
:func:`~mcore_compat.binding.placement.unshard` (the independent float64 reference's assembly). The two must be
equal exactly, name for name. The reference reads nothing the binding recorded, so a manifest that places a
shard wrongly (the ``gather_full_wrong_stride`` fault: a partition stride recorded wrong at bind time) or a
transfer that moves the wrong bytes FAILS it. N/A when the binding leaves parameters unbound (expert params on
0.4/0.5: gather_full refuses such a binding).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._util.own_math import own_tensor_math
from ..launch import gather_objects
from .report import Check

__all__ = ["NAME", "gather_full_check", "inject_wrong_stride"]

NAME = "gather_full_matches"


def _reference(chunks: list[Any], tp_rank: int, etp_rank: int) -> dict[str, Any]:
    """Full weights from every rank's parameters exchanged one tensor at a time (collective)."""

    from ..binding.placement import placements, unshard
    from ..layout.read import unwrap

    mine = []
    for chunk in chunks:
        core = unwrap(chunk)
        places = placements(core)
        for name, p in core.named_parameters():
            pl = places[name]
            if pl.tied_to is not None:
                continue
            rank = (etp_rank if pl.expert is not None else tp_rank) if pl.tp_split else 0
            mine.append((pl.full_name, rank, p.detach().cpu().clone(), pl.tp_split, pl.partition_dim,
                         pl.partition_stride))
    everyone = gather_objects(mine)
    shards: dict[str, dict[int, tuple[Any, bool, int, int]]] = {}
    for records in everyone:
        for name, rank, t, split, dim, stride in records:
            shards.setdefault(name, {}).setdefault(rank, (t, split, dim, stride))
    full = {}
    for name, by_rank in shards.items():
        t, split, dim, stride = by_rank[min(by_rank)]
        full[name] = unshard([by_rank[r][0] for r in sorted(by_rank)], dim, stride) if split else t
    return full


@own_tensor_math
def gather_full_check(binding: Any, chunks: list[Any]) -> Check:
    """The check on every rank (collective: every rank calls it)."""
    import torch

    from ..binding import BindingError, gather_full
    from ..binding.placement import coordinates

    unbound = gather_objects(list(binding.unbound))
    left_out = sorted({n for names in unbound for n in names})
    if left_out:
        return Check.not_applicable(NAME, f"{len(left_out)} parameter(s) not bound (e.g. {left_out[0]}): "
                                          f"gather_full refuses a binding that would leave them out")
    c = coordinates()
    want = _reference(chunks, c.tp_rank, c.etp_rank)
    try:
        got = {n: t.cpu() for n, t in gather_full(binding).items()}
    except BindingError as exc:
        return Check(NAME, False, f"gather_full refused: {str(exc).splitlines()[0]}")
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    wrong = [n for n in want if n in got and not (got[n].shape == want[n].shape and torch.equal(got[n], want[n]))]
    ok = not (missing or extra or wrong)
    n_bytes = sum(t.numel() * t.element_size() for t in want.values())
    return Check(NAME, ok,
                 f"{len(want) - len(missing) - len(wrong)}/{len(want)} full single-rank tensors ({n_bytes} bytes) "
                 f"from gather_full equal the per-tensor exchange joined from Megatron's attributes, exactly"
                 + (f"; missing {missing[:3]}" if missing else "") + (f"; unexpected {extra[:3]}" if extra else "")
                 + (f"; differ {wrong[:3]}" if wrong else ""),
                 {"missing": missing, "extra": extra, "differ": wrong})


def inject_wrong_stride(binding: Any) -> None:
    """The ``gather_full_wrong_stride`` fault: the binding records partition stride 2 for the first TP-split
    parameter whose stride is 1 (every rank alike), as a bug reading Megatron's attributes at bind time would."""
    for slot in binding._slots:
        pl = slot.placement
        if pl is not None and pl.tp_split and pl.partition_stride == 1 and slot.shape[pl.partition_dim] % 2 == 0:
            slot.placement = dataclasses.replace(pl, partition_stride=2)
            return
