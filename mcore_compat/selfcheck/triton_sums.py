"""The two sums of a fingerprint (:mod:`.fingerprint`) in one pass on a GPU: a Triton kernel.

A fingerprint is ``[sum(v_i), sum((i + 1) * v_i)]`` over a tensor's bits ``v_i`` (integers of its element width),
modulo 2**64. Torch has no one-pass reduction for it: eagerly it widens the tensor to an int64 copy first, and
compiled by TorchInductor it cost ~135 us of host time per call (an H200, ``benchmarks/profile_check_step.py``:
938 such calls per checked step of a 0.94 B GPT, the check bound by the host). Triton (the compiler torch itself
generates GPU kernels with, shipped with CUDA builds of torch) reads each element once, widens it in registers
and adds each block's two partial sums atomically: one launch per tensor, no temporary. int64 arithmetic wraps
modulo 2**64 in Triton as in torch, and integer addition is exact in any order, so the sums equal the definition
(:func:`.fingerprint._direct_sums`) bit for bit, whatever the block order.

:func:`enabled` is true on CUDA where Triton imports, unless ``MCORE_COMPAT_FUSE=0``; after a failure (one
warning) the fingerprints fall back to torch reductions.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

__all__ = ["add_sums", "enabled"]

#: elements per Triton program (each adds its two partial sums atomically)
BLOCK = 4096

_KERNEL: list[Any] = []
_FAILED: list[str] = []


def enabled(device: Any) -> bool:
    """Whether :func:`add_sums` runs for tensors on ``device``."""
    if getattr(device, "type", str(device)) != "cuda" or _FAILED or os.environ.get("MCORE_COMPAT_FUSE", "1") == "0":
        return False
    return bool(_KERNEL) or _build()


def _build() -> bool:
    try:
        from . import _triton_kernel

        kernel = _triton_kernel.fingerprint_sums
    except Exception as exc:  # no Triton (a CPU build of torch): torch's reductions
        _FAILED.append(f"{type(exc).__name__}: {exc}")
        return False
    _KERNEL.append((_triton_kernel.triton, kernel))
    return True


def add_sums(ints: Any, out: Any) -> bool:
    """Add ``[sum(v_i), sum((i + 1) * v_i)]`` of the contiguous 1-d integer tensor ``ints`` into ``out`` (2
    int64 elements on its device, zero for a fresh fingerprint); ``False`` (nothing added) where the kernel
    cannot run, after one warning."""
    if not enabled(ints.device):
        return False
    triton, kernel = _KERNEL[0]
    n = ints.numel()
    try:
        kernel[(triton.cdiv(n, BLOCK),)](ints, out, n, BLOCK=BLOCK)
    except Exception as exc:
        _FAILED.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        warnings.warn(f"mcore_compat: the fingerprint kernel could not run ({_FAILED[-1]}); fingerprints use "
                      f"torch's reductions (slower, the same values). MCORE_COMPAT_FUSE=0 skips it.",
                      RuntimeWarning, stacklevel=2)
        return False
    return True
