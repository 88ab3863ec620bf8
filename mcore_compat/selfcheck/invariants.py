"""What must hold across ranks, recomputed here: replicated params bit-identical over their groups, and the
global gradient norm with every element of the model counted once.

Replicas are compared by digests (two 64-bit sums of each param's bit patterns, one weighted by position), so
the check moves a few bytes per param whatever the model's size; any change of bits that is not an
adversarially chosen pair changes a digest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._util.own_math import own_tensor_math
from .reference import ceil_log2
from .wrappers import unwrap_ddp

__all__ = ["ReplicaResult", "compare_replicas", "digest", "global_grad_norm"]

#: Elements per block when digesting (bounds the int64 temporaries).
_BLOCK = 1 << 22
_INT_OF_SIZE = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


@own_tensor_math
def digest(tensor: Any) -> Any:
    """``[sum of bits, sum of bits * position]`` of ``tensor``'s elements as int64 (wrapping), on its device."""
    import torch

    flat = tensor.detach().reshape(-1)
    if flat.dtype.is_floating_point:
        flat = flat.contiguous().view(getattr(torch, _INT_OF_SIZE[flat.element_size()]))
    out = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for lo in range(0, flat.numel(), _BLOCK):
        bits = flat[lo:lo + _BLOCK].to(torch.int64)
        pos = torch.arange(lo + 1, lo + 1 + bits.numel(), dtype=torch.int64, device=flat.device)
        out[0] += bits.sum()
        out[1] += (bits * pos).sum()
    return out


class ReplicaResult:
    """Which replica groups were compared, how many elements, and what differed."""

    def __init__(self) -> None:
        self.labels: set[str] = set()
        self.elements = 0
        self.failures: list[str] = []


def _sets(groups: Any, named: list[tuple[str, Any]]) -> list[tuple[str, Any, list[tuple[str, Any]]]]:
    """``(label, process group, [(name, param)])`` for every group params are replicated over."""
    g = groups
    dense = [(n, p) for n, p in named if getattr(p, "allreduce", True)]
    out = []
    if g.dp_size > 1:
        out.append(("data-parallel", g.dp, dense))
    if g.edp_size > 1:
        out.append(("expert-data-parallel", g.edp, [(n, p) for n, p in named if not getattr(p, "allreduce", True)]))
    if g.tp > 1:
        out.append(("tensor-parallel duplicates", g.tp_group,
                    [(n, p) for n, p in dense if not getattr(p, "tensor_model_parallel", False)]))
    return [s for s in out if s[2]]


def compare_replicas(groups: Any, names: dict[Any, str], chunks: Sequence[Any], when: str) -> ReplicaResult:
    """Compare every replicated param over its groups (collective on every rank of the run)."""
    import torch
    import torch.distributed as dist

    result = ReplicaResult()
    named = [(n, p) for p, n in sorted(names.items(), key=lambda kv: kv[1])]
    for label, group, members in _sets(groups, named):
        mine = torch.stack([digest(p) for _, p in members])
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        result.labels.add(label)
        result.elements += sum(p.numel() for _, p in members)
        differ = sorted({members[i][0] for other in gathered for i in range(len(members))
                         if not torch.equal(other[i], mine[i])})
        if differ:
            result.failures.append(f"{when}: {label} replicas differ: {', '.join(differ[:4])}")
    tied = groups.tied_weight([unwrap_ddp(c) for c in chunks])
    if tied is not None:
        other = groups.exchange_tied(digest(tied))
        result.labels.add("tied embedding/output")
        result.elements += tied.numel()
        if not torch.equal(other, digest(tied)):
            result.failures.append(f"{when}: tied embedding/output weight differs between the first and last stage")
    return result


@own_tensor_math
def global_grad_norm(view: Any, grads: dict[int, Any], groups: Any, chunks: Sequence[Any], loss_scale: float
                     ) -> tuple[float, float]:
    """The global norm of the finalized gradients ``grads`` (``{id(main param): gradient part}``), each element
    of the model counted once: a main param's part where it is this rank's shard (distributed optimizer) or on
    the first data-parallel rank (expert-data-parallel for experts) where every such rank holds it whole;
    tensor-parallel duplicates on tensor-parallel rank 0; the last stage's copy of a tied weight never.

    Returns ``(norm, bound)``: fp32 sums of squares by pairwise/cascade reductions err by at most
    ``(ceil(log2 n) + T + R + 4) u`` relative (``n`` elements of the largest tensor, ``T`` tensors, ``R`` ranks).
    """
    import torch
    import torch.distributed as dist

    g = groups
    device = next((t.device for t in grads.values() if t is not None), torch.device("cpu"))
    if dist.get_backend() == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.zeros(1, dtype=torch.float64, device=device)
    biggest = 1
    tied = g.tied_weight([unwrap_ddp(c) for c in chunks])
    for mp in view:
        grad = grads.get(id(mp))
        if grad is None:
            continue
        expert = not getattr(mp.model, "allreduce", True)
        dp_first = (g.edp_rank if expert else g.dp_rank) == 0
        tp_first = getattr(mp.model, "tensor_model_parallel", False) or g.tp_rank == 0
        tied_copy = tied is not None and mp.model is tied and g.pp_rank != 0
        if (mp.sharded or dp_first) and tp_first and not tied_copy:
            total += torch.linalg.vector_norm(grad, dtype=torch.float64).square() / (loss_scale * loss_scale)
            biggest = max(biggest, mp.model.numel())
    dist.all_reduce(total)
    count = torch.tensor([len(view.params)], dtype=torch.float64, device=device)
    dist.all_reduce(count)
    norm = float(total.sqrt())
    rel = (ceil_log2(biggest) + ceil_log2(int(count.item()) + 1) + ceil_log2(dist.get_world_size()) + 4) * 2.0**-24
    return norm, rel * norm
