"""``own_tensor_math``: mark a function whose tensor math is mcore_compat's own, so that the CPU harness's
``cuda_factory`` mode (a TorchFunctionMode that turns CUDA device requests into CPU ones) is set aside while it runs.

Why: the mode sends every torch call of its thread through Python. In a CPU self-check most torch calls are
mcore_compat's own (fingerprints, comparisons, the optimizer oracle, offload bookkeeping: measured on 0.12.3, 5 of
every 6 calls the mode saw), and none of them names a CUDA device: they allocate on the devices of the tensors they
read. Megatron's code, which does name ``"cuda"``, keeps the mode. Without the patch applied (GPUs, or a CPU run
without the harness) the decorator costs one dictionary lookup.

Rule for its use: only on functions that call no Megatron code that allocates (Megatron objects may be read).
A mistake shows loudly on CPU ("Torch not compiled with CUDA enabled"), never silently.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")

_CPU_PATCHES = "mcore_compat.patches.cpu"


def own_tensor_math(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``fn`` with the CPU harness's cuda_factory mode set aside (a no-op where it is not applied)."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        cpu = sys.modules.get(_CPU_PATCHES)
        if cpu is None or not cpu._MODES:
            return fn(*args, **kwargs)
        with cpu.cuda_factory_set_aside():
            return fn(*args, **kwargs)

    return wrapper
