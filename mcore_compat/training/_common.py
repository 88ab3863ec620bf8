"""Small helpers shared by the training-step modules (installed version, groups, configs)."""

from __future__ import annotations

import dataclasses
import importlib
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from packaging.version import Version

from ..errors import InvalidTypeError


def installed_version() -> Version:
    """The detected megatron-core release."""
    from ..detect import detect

    return detect().version


def mcore(module: str) -> Any:
    """Import ``megatron.core.<module>`` (``module=""`` for ``megatron.core`` itself)."""
    return importlib.import_module(f"megatron.core.{module}" if module else "megatron.core")


def parallel_state() -> Any:
    """``megatron.core.parallel_state``."""
    return mcore("parallel_state")


def as_chunk_list(model: Any) -> tuple[list[Any], bool]:
    """``(chunks, was_list)``: a module or a list/tuple of modules as a list."""
    if isinstance(model, (list, tuple)):
        return list(model), True
    return [model], False


def model_config(chunk: Any) -> Any:
    """The config object a (possibly wrapped) model chunk really uses (Megatron's ``get_model_config``)."""
    return mcore("utils").get_model_config(chunk)


def group_ranks(group: Any) -> tuple[int, ...] | None:
    """Global ranks of a process group (``None`` for ``None``)."""
    if group is None:
        return None
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group))


def same_group(a: Any, b: Any) -> bool:
    """Whether two process groups contain the same global ranks (or are the same object)."""
    return a is b or group_ranks(a) == group_ranks(b)


def default_dp_group(*, gloo: bool = False) -> Any:
    """parallel_state's data-parallel x context-parallel group (the one Megatron's DDP/optimizer use by default).

    ``with_context_parallel`` is a keyword in every release (its position changed in 0.19), so keywords only.
    """
    ps = parallel_state()
    getter = ps.get_data_parallel_group_gloo if gloo else ps.get_data_parallel_group
    return getter(with_context_parallel=True)


def default_expert_dp_group() -> Any:
    """parallel_state's group over which expert parameters are data-parallel (the data-modulo-expert group,
    renamed expert-data-parallel group in 0.10), or ``None`` when it is not initialised."""
    ps = parallel_state()
    for name in ("get_data_modulo_expert_parallel_group", "get_expert_data_parallel_group"):
        getter = getattr(ps, name, None)
        if getter is not None:
            try:
                return getter()
            except Exception:  # not initialised (no expert parallelism configured)
                return None
    return None


def unique(seq: Sequence[Any]) -> list[Any]:
    """Items of ``seq`` without repeats (by identity), order kept."""
    seen: set[int] = set()
    out = []
    for item in seq:
        if id(item) not in seen:
            seen.add(id(item))
            out.append(item)
    return out


def config_items(value: Any, what: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(items, defaults)`` of a mapping or a dataclass instance; ``defaults`` are the dataclass's field defaults
    (empty for a mapping).

    Raises:
        InvalidTypeError: ``value`` is neither; the message says what to pass (``what``).
    """
    if isinstance(value, Mapping):
        return dict(value), {}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}
        defaults = {f.name: f.default for f in dataclasses.fields(value) if f.default is not dataclasses.MISSING}
        return items, defaults
    raise InvalidTypeError(f"cannot use {type(value).__name__} as {what}")


def is_finite_real(value: Any) -> bool:
    """A finite real number (an int, a float, a NumPy scalar), not a ``bool``, ``None`` or a string."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))


def is_integer(value: Any) -> bool:
    """An integral number, not a ``bool``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
