"""Tensor helpers of the step's checks: the pre-step values of a main param (:class:`Pre`), blocks and packs of
elements, per-entry reductions without a host sync, and small readers of optimizer state, losses and settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..._util.optimizer_view import MainParam
from .. import fused
from ..oracle import _is_tensor


@dataclass
class Pre:
    p0: Any
    state0: dict[str, Any]
    group: dict[str, Any] | None
    grad: Any = None


def clone_state(state: dict[str, Any], copied: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of an optimizer state; ``copied``: entries already copied elsewhere (the host snapshot), taken as
    they are."""
    copied = copied or {}
    out = {}
    for k, v in state.items():
        out[k] = copied[k] if k in copied else (v.detach().clone() if hasattr(v, "detach") else v)
    return out


#: Main params of at most this many elements share blocks of the rule (biases, norms: one evaluation for all).
PACK_MAX = 1 << 16


#: Small params per packed block of the gradient comparison (at most this many times :data:`PACK_MAX` elements).
PACK_COUNT = 32


#: Elements per block of the float64 rule run op by op (bounds the temporaries: ~14 float64 tensors of this size);
#: compiled into fused kernels on CUDA the blocks are larger (:func:`.fused.block_elements`).
BLOCK = fused.EAGER_BLOCK


def pack(entries: list[tuple[Any, ...]], members: list[int], block: int) -> list[list[tuple[int, int, int]]]:
    """Blocks of pieces ``(entry, lo, hi)`` of ``members``' main params, each block <= ``block`` elements:
    a large param in blocks of its own, small ones packed together."""
    blocks: list[list[tuple[int, int, int]]] = []
    open_block: list[tuple[int, int, int]] = []
    size = 0
    for e in members:
        n = entries[e][0].main.numel()
        if n > PACK_MAX:
            blocks.extend([(e, lo, hi)] for lo, hi in block_ranges(n, block))
            continue
        if not n:
            continue
        if size + n > block and open_block:
            blocks.append(open_block)
            open_block, size = [], 0
        open_block.append((e, 0, n))
        size += n
    if open_block:
        blocks.append(open_block)
    return blocks


def read_scalars(scalars: list[Any]) -> list[float]:
    """Device scalars as floats (one host sync per call)."""
    import torch

    if not scalars:
        return []
    return [float(x) for x in torch.stack([x.to(scalars[0].device) for x in scalars]).tolist()]


def per_entry(ids: list[Any], worst_parts: list[Any], over_parts: list[Any], n: int) -> tuple[Any, Any]:
    """Per entry of ``n`` (``ids``: the entry index of each block's values): the largest of its blocks' worst
    ratios and the sum of their counts over the bound, in float64 on the blocks' device (no host sync)."""
    import torch

    dev = worst_parts[0].device
    index = torch.cat(ids).to(dev, non_blocking=True)
    worst = torch.zeros(n, dtype=torch.float64, device=dev).scatter_reduce_(0, index, torch.cat(worst_parts), "amax")
    over = torch.zeros(n, dtype=torch.float64, device=dev).index_add_(0, index, torch.cat(over_parts))
    return worst, over


def segments(lengths: list[int], device: Any) -> Any:
    """Each element's segment index for segments of ``lengths`` (on ``device``; the output size given, so no host
    sync)."""
    import torch

    counts = torch.tensor(lengths, dtype=torch.int64).to(device, non_blocking=True)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), counts, output_size=sum(lengths))


def block_ranges(n: int, size: int = 0) -> list[tuple[int, int]]:
    size = size or BLOCK
    return [(lo, min(lo + size, n)) for lo in range(0, max(n, 1), size)]


def differing(mp: MainParam) -> Any:
    """How many elements of ``mp``'s part of its model param differ from the main param cast to the model's
    dtype (a float64 device scalar)."""
    want = mp.main.detach().reshape(-1).to(mp.model.dtype)
    return (mp.model_part(mp.model.detach()) != want).sum().double()


def on_device(t: Any, like: Any) -> Any:
    """``t`` on ``like``'s device (a host copy of the snapshot read back; asynchronous from pinned memory)."""
    return t if t.device == like.device else t.to(like.device, non_blocking=True)


def plain(v: Any) -> Any:
    """A 0-d state entry (Adam's ``step``) as a Python number (a compiled rule reads it without a host sync in
    the kernel's graph)."""
    if _is_tensor(v):
        value = float(v)
        return int(value) if value.is_integer() else value
    return v


def tensor_bytes(t: Any) -> int:
    return t.numel() * t.element_size() if hasattr(t, "element_size") else 0


def grad_dtype(param: Any) -> Any:
    main_grad = getattr(param, "main_grad", None)
    return main_grad.dtype if main_grad is not None else param.dtype


def state_of(mp: MainParam) -> dict[str, Any]:
    return dict(mp.inner.state.get(mp.main, {})) if mp.inner is not None else {}


def loss_value(d: Any) -> float | None:
    if isinstance(d, dict):
        for v in d.values():
            if hasattr(v, "numel") and v.numel() == 1:
                return float(v.float())
            if isinstance(v, (int, float)):
                return float(v)
        return None
    if hasattr(d, "numel") and d.numel() == 1:
        return float(d.float())
    return None


def clip_grad(optimizer: Any) -> float:
    for opt in [optimizer, *getattr(optimizer, "chained_optimizers", [])]:
        cfg = getattr(opt, "config", None)
        value = getattr(cfg, "clip_grad", None) if cfg is not None else None
        if value is None:
            value = getattr(opt, "clip_grad", None)
        if value is not None:
            return float(value)
    return 0.0
