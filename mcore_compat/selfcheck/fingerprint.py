"""Exact fingerprints of tensors: tell "changed" from "unchanged" without keeping a copy.

A fingerprint reads a tensor's bits (the tensor viewed as integers of its element width) and keeps two sums
over the elements ``v_i``, modulo 2**64 (int64 arithmetic wraps): ``sum(v_i)`` and ``sum((i + 1) * v_i)``,
plus the dtype, shape and element count. Any change of one element alters the first sum (the difference of two
distinct bit patterns is nonzero and below 2**64 in magnitude); any change of two elements that keeps the first
sum (``d_j = -d_i``) alters the second by ``(j - i) * d_i``, which is nonzero modulo 2**64 for the sizes here
(``|j - i| < 2**31``, ``|d_i| < 2**32`` for 32-bit elements). Changes of three or more elements could cancel in
both sums only by a coincidence of the changed values (not by rounding, scaling, zeroing or a stale copy, the
faults the self-check injects); a mismatch says *that* a tensor changed, not *where*.

Cost: on CUDA one pass and one launch per tensor (:mod:`.triton_sums`; without Triton, a compiled reduction,
:mod:`.fused`). Elsewhere the elements are read as a matrix of :data:`_COLS` columns, twice: its row sums
``S_r`` and column sums ``T_c`` (no index tensor: ``sum((i + 1) * v_i) = _COLS * sum(r * S_r) + sum((c + 1) *
T_c)`` for ``i = r * _COLS + c``, the same value as the direct sum modulo 2**64). Small tensors are summed
together (:func:`fingerprints`). The sums stay on the tensor's device until :func:`changed` compares many
fingerprints at once (one host sync per device, not one per tensor).
"""

from __future__ import annotations

from typing import Any

from .._util.own_math import own_tensor_math
from . import fused, triton_sums

__all__ = ["Fingerprint", "changed", "fingerprint", "fingerprints"]

#: the index weights kept per device (``1..n``) are at least this long
_MIN_WEIGHTS = 1 << 14

#: columns of the matrix a tensor's elements are read as (:func:`fingerprint`)
_COLS = 1024

#: ``(what is known on the host: dtype, shape, count or a plain value; the two sums as a device tensor or None)``
Fingerprint = tuple[tuple[Any, ...], Any]

_INT_OF_WIDTH = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def fingerprint(t: Any, into: Any = None) -> Fingerprint:
    """The fingerprint of ``t`` (a tensor: its bits; anything else: itself). ``into``: 2 zeroed int64 elements
    on ``t``'s device the sums may be added into (one allocation for many fingerprints)."""
    import torch

    if not (hasattr(t, "detach") and hasattr(t, "element_size")):
        return ("value", t), None
    x = t.detach()
    flat = x.reshape(-1) if x.is_contiguous() else x.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    ints = flat.view(getattr(torch, _INT_OF_WIDTH[flat.element_size()]))
    n = ints.numel()
    if n and triton_sums.enabled(ints.device):  # one pass, one launch (:mod:`.triton_sums`)
        out = into if into is not None else torch.zeros(2, dtype=torch.int64, device=ints.device)
        if triton_sums.add_sums(ints, out):
            return (str(x.dtype), tuple(x.shape), n), out
    if n and fused.enabled(ints.device):  # compiled: one graph, but ~135 us of host time per call
        return (str(x.dtype), tuple(x.shape), n), fused.run(_direct_sums, ints.device, ints)
    rows = n // _COLS
    sums = torch.zeros(2, dtype=torch.int64, device=ints.device)
    if rows:  # two reductions that accumulate in int64 as they read: no temporary of the tensor's size
        m = ints[:rows * _COLS].view(rows, _COLS)
        row, col = m.sum(dim=1, dtype=torch.int64), m.sum(dim=0, dtype=torch.int64)
        total = row.sum()
        weighted = (row * _weights(ints.device, rows)).sum() - total  # sum of r * S_r, r from 0
        sums = torch.stack([total, _COLS * weighted + (col * _weights(ints.device, _COLS)).sum()])
    if rows * _COLS < n:  # the last, partial row: the direct sums
        v = ints[rows * _COLS:].to(torch.int64)
        w = _weights(ints.device, n - rows * _COLS).add(rows * _COLS)
        sums += torch.stack([v.sum(), torch.mul(v, w).sum()])
    return (str(x.dtype), tuple(x.shape), n), sums


def _direct_sums(ints: Any) -> Any:
    """``[sum(v_i), sum((i + 1) * v_i)]`` of an integer tensor, as int64 (wrapping modulo 2**64): the
    definition (the tests compare :func:`fingerprint` with it)."""
    import torch

    v = ints.to(torch.int64)
    w = torch.arange(1, v.numel() + 1, dtype=torch.int64, device=v.device)
    return torch.stack([v.sum(), (v * w).sum()])


#: tensors up to this many elements are fingerprinted together (one concatenation and segment sums per device
#: and element width, a handful of kernels for hundreds of small tensors)
_SMALL = 1 << 18


@own_tensor_math
def fingerprints(items: list[Any]) -> list[Fingerprint]:
    """``[fingerprint(x) for x in items]`` (the same values), small tensors summed together."""
    import torch

    out: list[Fingerprint | None] = [None] * len(items)
    groups: dict[tuple[Any, int], list[int]] = {}
    large: list[int] = []
    for i, x in enumerate(items):
        if hasattr(x, "detach") and hasattr(x, "element_size") and 0 < x.numel() <= _SMALL \
                and x.dtype != torch.bool:
            groups.setdefault((x.device, x.element_size()), []).append(i)
        elif hasattr(x, "detach") and hasattr(x, "element_size") and x.numel() and triton_sums.enabled(x.device):
            large.append(i)
        else:
            out[i] = fingerprint(x)
    if large:  # the kernel adds into rows of one zeroed tensor per device
        by_device: dict[Any, list[int]] = {}
        for i in large:
            by_device.setdefault(items[i].device, []).append(i)
        for device, idx in by_device.items():
            rows = torch.zeros(len(idx), 2, dtype=torch.int64, device=device)
            for k, i in enumerate(idx):
                out[i] = fingerprint(items[i], rows[k])
    for (device, width), idx in groups.items():
        int_dtype = getattr(torch, _INT_OF_WIDTH[width])
        flats = [items[i].detach().reshape(-1).view(int_dtype) for i in idx]
        lengths = torch.tensor([f.numel() for f in flats], dtype=torch.int64)
        v = torch.cat(flats).to(torch.int64)
        # the size given and the host-to-device copies non-blocking: no host sync
        seg = torch.repeat_interleave(torch.arange(len(idx), device=device), lengths.to(device, non_blocking=True),
                                      output_size=v.numel())
        starts = (torch.cumsum(lengths, 0) - lengths).to(device, non_blocking=True)
        w = torch.arange(1, v.numel() + 1, dtype=torch.int64, device=device) - starts[seg]
        sums = torch.zeros(len(idx), 2, dtype=torch.int64, device=device)
        sums[:, 0].index_add_(0, seg, v)
        sums[:, 1].index_add_(0, seg, v * w)
        for k, i in enumerate(idx):
            x = items[i]
            out[i] = ((str(x.dtype), tuple(x.shape), x.numel()), sums[k])
    return [f for f in out if f is not None]


_WEIGHTS: dict[Any, Any] = {}


def _weights(device: Any, n: int) -> Any:
    """``1..n`` (int64) on ``device``, cut from one cached range."""
    import torch

    w = _WEIGHTS.get(device)
    if w is None or w.numel() < n:
        w = _WEIGHTS[device] = torch.arange(1, max(n, _MIN_WEIGHTS, _COLS) + 1, dtype=torch.int64, device=device)
    return w[:n]


@own_tensor_math
def changed(pairs: list[tuple[Fingerprint, Fingerprint]]) -> list[bool]:
    """For each pair of fingerprints: do they differ (one host sync per device for all pairs)?"""
    import torch

    out = [a[0] != b[0] or (a[1] is None) != (b[1] is None) for a, b in pairs]
    by_device: dict[Any, list[int]] = {}
    for i, (a, b) in enumerate(pairs):
        if not out[i] and a[1] is not None and b[1] is not None:
            by_device.setdefault(a[1].device, []).append(i)
    for idx in by_device.values():
        neq = (torch.stack([pairs[i][0][1] for i in idx]) != torch.stack([pairs[i][1][1] for i in idx])).any(dim=1)
        for i, d in zip(idx, neq.tolist(), strict=True):
            out[i] = bool(d)
    return out
