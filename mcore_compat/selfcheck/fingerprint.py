"""Exact fingerprints of tensors: tell "changed" from "unchanged" without keeping a copy.

A fingerprint reads a tensor's bits (the tensor viewed as integers of its element width) and keeps two sums
over the elements ``v_i``, modulo 2**64 (int64 arithmetic wraps): ``sum(v_i)`` and ``sum((i + 1) * v_i)``,
plus the dtype, shape and element count. Any change of one element alters the first sum (the difference of two
distinct bit patterns is nonzero and below 2**64 in magnitude); any change of two elements that keeps the first
sum (``d_j = -d_i``) alters the second by ``(j - i) * d_i``, which is nonzero modulo 2**64 for the sizes here
(``|j - i| < 2**31``, ``|d_i| < 2**32`` for 32-bit elements). Changes of three or more elements could cancel in
both sums only by a coincidence of the changed values (not by rounding, scaling, zeroing or a stale copy, the
faults the self-check injects); a mismatch says *that* a tensor changed, not *where*. Cost: two integer passes
in blocks of ``_BLOCK`` elements, no copy of the tensor kept.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Fingerprint", "fingerprint"]

#: elements per block of the integer sums (bounds the int64 temporaries)
_BLOCK = 1 << 22

Fingerprint = tuple[Any, ...]

_INT_OF_WIDTH = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def fingerprint(t: Any) -> Fingerprint:
    """The fingerprint of ``t`` (a tensor: its bits; anything else: itself)."""
    import torch

    if not (hasattr(t, "detach") and hasattr(t, "element_size")):
        return ("value", t)
    x = t.detach()
    flat = x.reshape(-1) if x.is_contiguous() else x.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    ints = flat.view(getattr(torch, _INT_OF_WIDTH[flat.element_size()]))
    n = ints.numel()
    s1 = torch.zeros((), dtype=torch.int64, device=ints.device)
    s2 = torch.zeros((), dtype=torch.int64, device=ints.device)
    for lo in range(0, n, _BLOCK):
        hi = min(lo + _BLOCK, n)
        v = ints[lo:hi].to(torch.int64)
        s1 += v.sum()
        w = torch.arange(lo + 1, hi + 1, dtype=torch.int64, device=ints.device)
        s2 += (v * w).sum()
    return (str(x.dtype), tuple(x.shape), n, int(s1), int(s2))
