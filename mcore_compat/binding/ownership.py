"""Whether parameters own their storage, before :func:`~mcore_compat.binding.bind_params` moves them.

An allocated binding copies every parameter into a new flat buffer and rebinds its ``.data`` there. A
parameter that points into someone else's buffer (``p.data = my_flat[off:off + n].view(shape)``, or the flat
buffer of an earlier binding) would silently leave that buffer behind: whoever reads it (a rollout engine) keeps
seeing the weights of bind time. :func:`check_own_storage` refuses such parameters, all of them named, before
anything is changed. Megatron-Core's own parameter buffer makes the same demand of the parameters it moves
(``megatron/core/distributed/param_and_grad_buffer.py``, 0.6: ``assert old_param_data._base is None``).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from .errors import BindingError

if TYPE_CHECKING:
    from .param_binding import ParamBinding, Slot

__all__ = ["check_own_storage", "remember", "storage_problem"]

#: Bindings made by bind_params that may still be alive (to tell "bound by an earlier bind_params" apart).
_LIVE: weakref.WeakSet[ParamBinding] = weakref.WeakSet()

#: How many refused parameters an error names.
_SHOWN = 20


def remember(binding: ParamBinding) -> None:
    """Record a binding that :func:`~mcore_compat.binding.bind_params` made (held weakly)."""
    _LIVE.add(binding)


def storage_problem(tensor: torch.Tensor) -> str | None:
    """What is wrong with ``tensor``'s storage for moving it into a flat buffer (``None``: it owns its storage).

    Args:
        tensor: a parameter (or its ``.data``).

    Returns:
        ``None`` when the tensor starts its storage and fills it exactly (or has no elements: nothing to
        alias), else a short description: a view into a larger storage or at a nonzero storage offset.
    """
    if tensor.numel() == 0:
        return None
    storage = tensor.untyped_storage()
    need = tensor.numel() * tensor.element_size()
    if tensor.storage_offset() == 0 and storage.nbytes() == need:
        return None
    return (f"a view at element {tensor.storage_offset()} of a {storage.nbytes()}-byte storage (the parameter "
            f"has {need} bytes)")


def _bound_storages() -> set[int]:
    """Storage addresses of the flat buffers of every live, still bound binding."""
    return {f.untyped_storage().data_ptr() for b in list(_LIVE) if b.bound for f in b.flat_buffers()}


def check_own_storage(slots: list[Slot], zero_copy: list[bool]) -> None:
    """Refuse to move parameters that do not own their storage into allocated buffers.

    Args:
        slots: the parameters to bind and their places.
        zero_copy: per flat buffer, whether it is Megatron's ``param_data`` (nothing is moved there; those
            parameters are checked to live in it instead).

    Raises:
        BindingError: naming every parameter of an allocated buffer (up to 20) that is a view into a larger
            storage or at a nonzero storage offset, and which of them an earlier binding still holds.
    """
    found = [(s, problem) for s in slots if not zero_copy[s.buffer]
             for problem in [storage_problem(s.param.data)] if problem]
    if not found:
        return
    bound = _bound_storages()
    lines = [f"{s.name}: already bound by an earlier bind_params; call unbind() on that binding first"
             if s.param.data.untyped_storage().data_ptr() in bound else f"{s.name}: {problem}"
             for s, problem in found]
    more = f"\n  ... and {len(lines) - _SHOWN} more" if len(lines) > _SHOWN else ""
    raise BindingError(
        f"{len(lines)} parameter(s) do not own their storage: their param.data points into a larger buffer:\n  "
        + "\n  ".join(lines[:_SHOWN]) + more +
        "\nbind_params would copy them into new flat buffers and rebind param.data there, leaving that buffer "
        "stale: whoever reads it (a rollout engine) would keep the weights of bind time while training goes on. "
        "Nothing was changed. Call bind_params before pointing parameters into a buffer of your own and hand "
        "the binding's flat_buffers() / named_views() (with its manifest()) to the engine instead; or call "
        "unbind() on an earlier binding first; or give each parameter its own storage "
        "(p.data = p.data.clone()) if nothing reads that buffer."
    )
