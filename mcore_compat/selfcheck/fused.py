"""The per-element arithmetic of the step checks, fused into few kernels where torch can compile it.

The update check evaluates per element a few dozen float64 operations (the optimizer's rule and its rounding
bound, then the error of what the step produced) and the gradient check a handful; both keep only reductions.
Run op by op (eager), every operation is a kernel launch and a pass over memory, so on a GPU the check is bound
by launches and bandwidth (an H200, ``benchmarks/profile_check_step.py``: 23,224 launches for one checked step of
a 0.34 B GPT). On CUDA, :func:`run` hands the same Python function to ``torch.compile`` (TorchInductor: a library
made for exactly this fusion), which reads the inputs once and writes only the reductions; the blocks can then be
large (:func:`block_elements`), as no temporaries of the block's size are kept.

The function is the same in both modes, so the CPU tests prove its arithmetic; the compiled kernels evaluate the
same float64 expressions (possibly contracted into fused multiply-adds: differences of ~2^-53 relative, far
below the 2^-24 bounds they are compared with). Eager on the CPU (the self-check's models are small; compiling
costs more there than it saves), where compiling is switched off (``MCORE_COMPAT_FUSE=0``) and, after one
warning, wherever compiling fails. The first call per process compiles (~13 s on an H200 for the update rule,
measured; then cached by TorchInductor on disk for later processes).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["block_elements", "enabled", "run"]

#: elements per block when run op by op (bounds the temporaries: ~14 float64 tensors of this size)
EAGER_BLOCK = 1 << 21
#: elements per block when compiled (the fused kernels keep no temporary of the block's size)
FUSED_BLOCK = 1 << 25

_COMPILED: dict[Any, Any] = {}
_FAILED: list[str] = []


def enabled(device: Any) -> bool:
    """Whether :func:`run` compiles for tensors on ``device``: CUDA, compiling not switched off or failed."""
    if getattr(device, "type", str(device)) != "cuda" or _FAILED:
        return False
    return os.environ.get("MCORE_COMPAT_FUSE", "1") != "0"


def block_elements(device: Any) -> int:
    """Elements per block of the checks on ``device``."""
    return FUSED_BLOCK if enabled(device) else EAGER_BLOCK


def run(fn: Callable[..., Any], device: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, compiled into fused kernels where :func:`enabled` (compiled once per function)."""
    if not enabled(device):
        return fn(*args, **kwargs)
    compiled = _COMPILED.get(fn)
    if compiled is None:
        import torch

        compiled = _COMPILED[fn] = torch.compile(fn, dynamic=True)
    try:
        return compiled(*args, **kwargs)
    except Exception as exc:
        _FAILED.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        warnings.warn(f"mcore_compat: the self-check's fused kernels could not be compiled ({_FAILED[0]}); it "
                      f"runs op by op (slower, the same verdicts). Set MCORE_COMPAT_FUSE=0 to skip compiling.",
                      RuntimeWarning, stacklevel=2)
        return fn(*args, **kwargs)
