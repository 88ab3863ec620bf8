"""The float64 copy of a caller's model chunk that :mod:`.directional`'s finite differences evaluate: the same layer
code, parameters cast exactly, ``Tensor.float()`` of a float64 tensor left in float64, inputs cast to float64;
and the probes of whether its dropout masks can match the model's."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any


def dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


# ------------------------------------------------------------------------------------------------ the float64 copy
def float64_copy(module: Any) -> Any:
    """A float64 copy of ``module`` (DDP and ``Float16Module`` stripped): parameters and floating buffers cast from
    the module's (exactly), the same process groups, its configs copied with ``params_dtype`` float64 and the
    bf16/fp16 flags off (the schedule's hooks cleared), softmax modules' half-precision input flags off."""
    import torch

    from .reference import _plain_copy, _without_hooks
    from .wrappers import core_module

    core = core_module(module)
    configs: dict[int, Any] = {}
    for sub in core.modules():
        cfg = sub.__dict__.get("config")
        if cfg is not None and id(cfg) not in configs:
            mine = copy.copy(_without_hooks(cfg))
            if mine is cfg:
                mine = copy.copy(cfg)
            for attr, value in (("params_dtype", torch.float64), ("bf16", False), ("fp16", False)):
                if hasattr(mine, attr):
                    try:
                        object.__setattr__(mine, attr, value)
                    except (AttributeError, TypeError):
                        pass
            configs[id(cfg)] = mine
    dup = _plain_copy(core, dtype=torch.float64, configs=configs)
    dup.double()
    for sub in dup.modules():
        for flag in ("input_in_fp16", "input_in_bf16", "input_in_float16"):
            if isinstance(sub.__dict__.get(flag), bool):
                setattr(sub, flag, False)
    for p in dup.parameters():
        p.requires_grad_(False)
    return dup


@contextlib.contextmanager
def float_keeps_float64() -> Iterator[None]:
    """Within: ``Tensor.float()`` of a float64 tensor returns it (a loss function's ``output.float()`` would round
    the float64 copy's loss to float32); every other tensor as before."""
    import torch

    real = torch.Tensor.float

    def float_(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.dtype == torch.float64 and not args and not kwargs:
            return self
        return real(self, *args, **kwargs)

    torch.Tensor.float = float_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.float = real  # type: ignore[method-assign]


def inputs_to_float64(module: Any) -> Any:
    """A forward pre-hook handle casting the floating tensor inputs of ``module`` to float64 (Megatron's
    ``Float16Module`` casts the model's inputs to its dtype the same way)."""
    import torch

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64:
            return x.double()
        return x

    def hook(_m: Any, args: Any, kwargs: Any) -> Any:
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    return module.register_forward_pre_hook(hook, with_kwargs=True)


def dropout_reproducible(device: Any, dtype: Any) -> bool:
    """Whether dropout on ``device`` draws the same mask for a float64 tensor as for one of ``dtype`` from the same
    generator state (a probe: the CPU draws per element independent of the dtype; an accelerator's kernel may
    not)."""
    import torch

    from .rng_replay import capture, restore

    left = capture()
    try:
        x = torch.ones(4096, device=device)
        masks = []
        for dt in (dtype, torch.float64):
            restore(left)
            masks.append(torch.nn.functional.dropout(x.to(dt), 0.5, training=True) != 0)
        return bool(torch.equal(masks[0], masks[1]))
    finally:
        restore(left)


def has_dropout(chunk: Any) -> bool:
    from .wrappers import core_module

    for m in core_module(chunk).modules():
        cfg = m.__dict__.get("config")
        for name in ("hidden_dropout", "attention_dropout"):
            if cfg is not None and isinstance(getattr(cfg, name, 0.0), float) and getattr(cfg, name) > 0:
                return True
        p = m.__dict__.get("p")
        if "Dropout" in type(m).__name__ and isinstance(p, float) and p > 0:
            return True
    return False
