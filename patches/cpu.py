"""Patches of purpose ``"cpu"``: run Megatron-Core's own DDP / optimizer / schedule code on a torch without a GPU.

They change only *where* tensors live and which branch a type-string check takes; Megatron's logic is untouched.
Measured on megatron-core 0.4.0 .. 0.19.2 with torch 2.13 (CPU build on Python 3.11, CUDA build without a GPU on
Python 3.12), world sizes 1 and 2 over gloo.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ._registry import Patch, applied, register
from ._tools import Changes, Undo, set_env, skipped, when_imported_checked

# Resolved at import: the C implementations inherited from TensorBase.
_OWN_TENSOR_TYPE = torch.Tensor.type
_TENSOR_TO = torch.Tensor.to
_TENSOR_CUDA = torch.Tensor.cuda


# --------------------------------------------------------------------------------------------- cuda_device
def _cpu_device() -> str:
    return "cpu"


def _apply_cuda_device() -> Undo:
    changes = Changes()
    changes.setattr(torch.cuda, "current_device", _cpu_device)
    return changes.undo


def _check_cuda_device() -> str | None:
    if not callable(getattr(torch.cuda, "current_device", None)):
        return "torch.cuda.current_device is missing"
    return None


register(
    Patch(
        name="cuda_device",
        versions=">=0.4",
        purposes=("cpu",),
        description=(
            "torch.cuda.current_device() returns 'cpu', so DDP's grad/param buffers "
            "(torch.zeros(..., device=torch.cuda.current_device())) are allocated on the CPU. "
            "Without it: 'Torch not compiled with CUDA enabled' / 'Found no NVIDIA driver' when DDP is built."
        ),
        apply_fn=_apply_cuda_device,
        check_fn=_check_cuda_device,
    )
)


# -------------------------------------------------------------------------------------------- cuda_factory
def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0].strip() == "cuda"
    # A bare int device means an accelerator index (torch.zeros(1, device=0) is cuda:0).
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device requests into CPU ones: ``device=`` keyword arguments of any torch function,
    the device argument of ``Tensor.to``, and ``Tensor.cuda()`` (returns the tensor itself)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is _TENSOR_CUDA:
            return args[0]
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is _TENSOR_TO and len(args) > 1 and not isinstance(args[1], torch.Tensor) and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _remove_mode(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off this thread's torch-function-mode stack, wherever it is, keeping the others in order."""
    above: list[Any] = []
    found = False
    while torch._C._len_torch_function_stack() > 0:
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            found = True
            break
        above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)
    if not found:
        import warnings

        warnings.warn(
            "mcore-compat: the cuda_factory TorchFunctionMode was not on this thread's mode stack (it is "
            "thread-local: revert it from the thread that applied it)",
            RuntimeWarning,
            stacklevel=3,
        )


#: The cuda_factory mode while the patch is applied (at most one).
_MODES: list[_CudaToCpu] = []


def _apply_cuda_factory() -> Undo:
    mode = _CudaToCpu()
    mode.__enter__()
    _MODES.append(mode)

    def undo() -> None:
        _MODES.remove(mode)
        _remove_mode(mode)

    return undo


@contextmanager
def cuda_factory_set_aside() -> Iterator[None]:
    """Take the cuda_factory mode off this thread's torch-function-mode stack while the block runs, and put it back.

    A TorchFunctionMode sends EVERY torch call of its thread through Python (about 5 us each), whether or not it
    asks for a device. mcore_compat's own tensor math (the self-check's comparisons, fingerprints and oracle, the
    offload bookkeeping) never names a CUDA device - it allocates on the devices of the tensors it reads - so it
    runs without the mode (:func:`mcore_compat._util.own_math.own_tensor_math`); Megatron's code keeps it. A no-op
    when the mode is not applied or is not the innermost mode of this thread (another mode entered above it).
    """
    n = torch._C._len_torch_function_stack()
    if not _MODES or n == 0 or torch._C._get_function_stack_at(n - 1) is not _MODES[-1]:
        yield
        return
    mode = torch._C._pop_torch_function_stack()
    try:
        yield
    finally:
        torch._C._push_on_torch_function_stack(mode)


def _check_cuda_factory() -> str | None:
    for name in ("_len_torch_function_stack", "_pop_torch_function_stack", "_push_on_torch_function_stack",
                 "_get_function_stack_at"):
        if not hasattr(torch._C, name):
            return f"this torch ({torch.__version__}) lacks torch._C.{name}, needed to undo the mode exactly"
    return None


register(
    Patch(
        name="cuda_factory",
        versions=">=0.6",
        purposes=("cpu",),
        description=(
            "A TorchFunctionMode, entered for the applying thread (not active in other threads, nor inside "
            "autograd backward hooks), that turns "
            "device='cuda' / device=<int> arguments, Tensor.to('cuda') and Tensor.cuda() into CPU. Megatron's "
            "optimizers, grad scalers, clip_grads and schedules create small tensors with device='cuda' "
            "(e.g. MixedPrecisionOptimizer found_inf, schedules total_num_tokens.cuda())."
        ),
        apply_fn=_apply_cuda_factory,
        check_fn=_check_cuda_factory,
    )
)


# --------------------------------------------------------------------------------------------- tensor_cuda
def _tensor_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


def _apply_tensor_cuda() -> Undo:
    changes = Changes()
    changes.setattr(torch.Tensor, "cuda", _tensor_cuda)
    return changes.undo


register(
    Patch(
        name="tensor_cuda",
        versions=">=0.7,<0.8",
        purposes=("cpu",),
        description=(
            "Tensor.cuda() returns the tensor itself (0.7.x: schedules.py does "
            "torch.tensor(0, dtype=torch.int).cuda()). cuda_factory already covers this on its thread (measured: "
            "0.7.0 runs without tensor_cuda), so apply_for skips it when cuda_factory is applied; apply it by "
            "name for a process-wide fallback (e.g. schedules run from another thread)."
        ),
        apply_fn=_apply_tensor_cuda,
        check_fn=lambda: None if callable(getattr(torch.Tensor, "cuda", None)) else "Tensor.cuda is missing",
        needed_when=lambda: "cuda_factory" not in applied(),
    )
)


# --------------------------------------------------------------------------------------------- tensor_type
def _tensor_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
    if dtype is None and not kwargs:
        name = _OWN_TENSOR_TYPE(self)
        if self.device.type == "cpu" and name.startswith("torch.") and not name.startswith("torch.cuda."):
            return "torch.cuda." + name[len("torch.") :]
        return name
    if isinstance(dtype, str) and dtype.startswith("torch.cuda.") and self.device.type == "cpu":
        dtype = "torch." + dtype[len("torch.cuda.") :]
    return _OWN_TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


def _apply_tensor_type() -> Undo:
    changes = Changes()
    changes.setattr(torch.Tensor, "type", _tensor_type)
    return changes.undo


def _check_tensor_type() -> str | None:
    if torch.zeros(1).type() != "torch.FloatTensor":
        return f"Tensor.type() of a CPU float tensor is {torch.zeros(1).type()!r}, not 'torch.FloatTensor'"
    return None


register(
    Patch(
        name="tensor_type",
        versions=">=0.6",
        purposes=("cpu",),
        description=(
            "Tensor.type() (no arguments) reports 'torch.cuda.FloatTensor' etc. for CPU tensors, so the "
            "optimizer wrappers take the branch they take on GPU. Without it: 'TypeError: Wrapped parameters "
            "must be one of torch.cuda.FloatTensor, ...' from the DistributedOptimizer / Float16Optimizer."
        ),
        apply_fn=_apply_tensor_type,
        check_fn=_check_tensor_type,
    )
)


# ------------------------------------------------------------------------------------------------------ rng
def _cpu_get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _megatron_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _megatron_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _patch_megatron_random(module: types.ModuleType) -> Undo:
    if not callable(getattr(module, "_set_cuda_rng_state", None)):
        return skipped("rng", f"{module.__name__} has no _set_cuda_rng_state")
    changes = Changes()
    changes.setattr(module, "_set_cuda_rng_state", _megatron_set_rng_state)
    if callable(getattr(module, "_get_cuda_rng_state", None)):  # not in every release (patches/_fingerprints.py)
        changes.setattr(module, "_get_cuda_rng_state", _megatron_get_rng_state)
    return changes.undo


#: What Megatron's ``CudaRNGStatesTracker.fork`` logs when the CPU generator moved inside a fork (0.9+,
#: tensor_parallel/random.py). With this patch the "CUDA" generator IS the CPU generator, so every dropout inside a
#: fork moves it by design; the message would be printed once per forked dropout (24 times for a small GPT step).
_FORK_CPU_WARNING = "CPU RNG state changed within GPU RNG context"


class _ForkCpuWarningFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _FORK_CPU_WARNING


def _filter_fork_warning() -> Undo:
    logger = logging.getLogger("megatron.core.tensor_parallel.random")
    flt = _ForkCpuWarningFilter()
    logger.addFilter(flt)
    return lambda: logger.removeFilter(flt)


def _apply_rng() -> Undo:
    import torch.cuda.random as cuda_random

    changes = Changes()
    changes.add(_filter_fork_warning())
    for mod in (torch.cuda, cuda_random):
        changes.setattr(mod, "get_rng_state", _cpu_get_rng_state)
        changes.setattr(mod, "set_rng_state", _cpu_set_rng_state)
        changes.setattr(mod, "manual_seed", _cpu_manual_seed)
    changes.add(when_imported_checked("rng", "megatron.core.tensor_parallel.random", _patch_megatron_random))
    return changes.undo


def _check_rng() -> str | None:
    for name in ("get_rng_state", "set_rng_state", "manual_seed"):
        if not callable(getattr(torch.cuda, name, None)):
            return f"torch.cuda.{name} is missing"
    return None


register(
    Patch(
        name="rng",
        versions=">=0.4",
        purposes=("cpu",),
        description=(
            "torch.cuda.get_rng_state/set_rng_state/manual_seed and Megatron's "
            "tensor_parallel.random._set_cuda_rng_state (and _get_cuda_rng_state where it exists) use the CPU generator, "
            "so model_parallel_cuda_manual_seed and the CudaRNGStatesTracker fork work (same tracker logic, CPU "
            "generator). The Megatron functions are patched when that module is imported (or now, if it is). "
            "The fork's warning 'CPU RNG state changed within GPU RNG context' (0.9+) is filtered from Megatron's "
            "logger: here the CPU generator is the one the fork swaps, so it moves by design."
        ),
        apply_fn=_apply_rng,
        check_fn=_check_rng,
        targets=("megatron.core.tensor_parallel.random:_set_cuda_rng_state",
                 "megatron.core.tensor_parallel.random:_get_cuda_rng_state"),
    )
)


# -------------------------------------------------------------------------------------------- cuda_arch_env
_ARCH_ENV = "TORCH_CUDA_ARCH_LIST"


def _cuda_arch_env_needed() -> bool:
    import os

    if os.environ.get(_ARCH_ENV):
        return False
    return torch.version.cuda is not None and torch.cuda.device_count() == 0


def _apply_cuda_arch_env() -> Undo:
    return set_env(_ARCH_ENV, "9.0")


register(
    Patch(
        name="cuda_arch_env",
        versions=">=0.15,<0.16",
        purposes=("cpu",),
        description=(
            f"Sets {_ARCH_ENV} (if unset) before megatron is imported. 0.15.x builds a CUDA extension with "
            "torch.utils.cpp_extension.load_inline when megatron.core is imported (inference/unified_memory.py); "
            "with a CUDA build of torch and no GPU, torch cannot pick an architecture and the import dies with "
            "'IndexError: list index out of range' (_get_cuda_arch_flags). With the variable set, the build "
            "fails with an error Megatron catches (a warning). Only needed with a CUDA build of torch and no GPU."
        ),
        apply_fn=_apply_cuda_arch_env,
        before_import=True,
        needed_when=_cuda_arch_env_needed,
        targets=("megatron.core.inference.unified_memory",),
    )
)


# --------------------------------------------------------------------------------------------- cuda_stream
class _CpuStream:
    """Stands in for a ``torch.cuda.Stream`` on the CPU: work is synchronous, so every wait is a no-op."""

    device = torch.device("cpu")

    def wait_event(self, event: Any) -> None:
        """No-op (CPU work is already complete)."""

    def wait_stream(self, stream: Any) -> None:
        """No-op (CPU work is already complete)."""

    def synchronize(self) -> None:
        """No-op (CPU work is already complete)."""

    def query(self) -> bool:
        """Always complete."""
        return True

    def record_event(self, event: Any = None) -> Any:
        """Returns ``event`` unchanged (nothing to record)."""
        return event


_CPU_STREAM = _CpuStream()


def _current_stream(device: Any = None) -> _CpuStream:
    return _CPU_STREAM


def _apply_cuda_stream() -> Undo:
    changes = Changes()
    changes.setattr(torch.cuda, "current_stream", _current_stream)
    changes.setattr(torch.cuda, "default_stream", _current_stream)
    return changes.undo


def _check_cuda_stream() -> str | None:
    for name in ("current_stream", "default_stream"):
        if not callable(getattr(torch.cuda, name, None)):
            return f"torch.cuda.{name} is missing"
    return None


register(
    Patch(
        name="cuda_stream",
        versions=">=0.19",
        purposes=("cpu",),
        description=(
            "torch.cuda.current_stream()/default_stream() return a CPU stand-in whose waits are no-ops. "
            "0.19.x _ParamAndGradBucketGroup.start_grad_sync calls torch.cuda.current_stream() unconditionally "
            "(to wait for CUDA-graph wgrad events): without it 'Found no NVIDIA driver' / 'Torch not compiled "
            "with CUDA enabled' at the first grad sync."
        ),
        apply_fn=_apply_cuda_stream,
        check_fn=_check_cuda_stream,
    )
)


# ----------------------------------------------------------------------------------------------- cuda_sync
def _no_sync(device: Any = None) -> None:
    """CPU work is synchronous: nothing to wait for."""


def _apply_cuda_sync() -> Undo:
    changes = Changes()
    changes.setattr(torch.cuda, "synchronize", _no_sync)
    return changes.undo


def _check_cuda_sync() -> str | None:
    return None if callable(getattr(torch.cuda, "synchronize", None)) else "torch.cuda.synchronize is missing"


register(
    Patch(
        name="cuda_sync",
        versions=">=0.4",
        purposes=("cpu",),
        description=(
            "torch.cuda.synchronize() is a no-op. The pipeline schedules' P2P exchange calls it after every "
            "batched send/recv (batch_p2p_comm and batch_p2p_sync default on, p2p_communication._communicate): "
            "without it PP>1 fails with 'Torch not compiled with CUDA enabled' / 'Found no NVIDIA driver'."
        ),
        apply_fn=_apply_cuda_sync,
        check_fn=_check_cuda_sync,
    )
)
