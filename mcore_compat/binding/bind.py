""":func:`bind_params`: bind the trainable parameters of DDP-wrapped model chunks to flat buffers.

The steps: check the chunks (wrapped in Megatron-Core's DDP, no ``ddp_config`` flag that makes ``param_data``
transient), read their layout (:func:`~mcore_compat.layout.layout_of`), pick one flat buffer per DDP buffer
(Megatron's own ``param_data`` when there is one, else a new tensor laid out like the grad buffer), check that
zero-copy parameters really live in ``param_data`` and that the others own their storage (all of them, before
anything changes), then copy the others into their new buffers and rebind their ``.data``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import torch

from ..layout import LAYOUT_FACTS, BufferLayout, LayoutError, ModelLayout, layout_of
from ..layout.read import ddp_buffers, unwrap
from .errors import BindingError
from .ownership import check_own_storage, remember
from .param_binding import ParamBinding, Slot, place_problem
from .placement import coordinates, placements
from .views import dtype_name, numel

__all__ = ["bind_params"]

#: Names of the DDP attributes that hold buffers, over all releases (from the layout table).
_DDP_BUFFER_ATTRS: Final = frozenset(
    attr for row in LAYOUT_FACTS["ddp_buffer_attrs"].rows for attr in row.value if attr is not None
)

#: ``ddp_config`` flags under which ``param_data`` is no persistent home of the weights (flag -> why).
_ALIASING_INVALID_FLAGS: Final[dict[str, str]] = {
    "reuse_grad_buf_for_mxfp8_param_ag": (
        "DDP's param_data is then a transient view of the gradient buffer, used only during the parameter "
        "all-gather and zeroed afterwards; the weights live in TE's quantized storage. Build DDP with "
        "reuse_grad_buf_for_mxfp8_param_ag=False to bind the parameters"
    ),
}


@dataclass
class _Buffers:
    """The flat buffers chosen so far: ``flats[i]`` is zero-copy when ``zero_copy[i]``, laid out as ``kept[i]``."""

    flats: list[torch.Tensor] = field(default_factory=list)
    zero_copy: list[bool] = field(default_factory=list)
    kept: list[BufferLayout] = field(default_factory=list)
    slots: list[Slot] = field(default_factory=list)


def _check_wrapped(chunks: list[Any]) -> None:
    for index, chunk in enumerate(chunks):
        if any(isinstance(getattr(chunk, attr, None), (list, tuple, dict)) for attr in _DDP_BUFFER_ATTRS):
            continue
        kind = type(chunk).__name__
        raise BindingError(
            f"model chunk {index} ({kind}) is not wrapped in Megatron-Core's DistributedDataParallel, so its "
            f"parameters are in no DDP buffer and there is no layout to bind them to. Wrap the chunks first "
            f"(mcore_compat.training.wrap_ddp(chunks, ddp_config=...)) and pass the wrapped chunks; FSDP-wrapped "
            f"models keep sharded parameters and cannot be bound."
        )


def _check_flags(chunks: list[Any]) -> None:
    for index, chunk in enumerate(chunks):
        cfg = getattr(chunk, "ddp_config", None)
        for flag, why in _ALIASING_INVALID_FLAGS.items():
            if cfg is not None and getattr(cfg, flag, False):
                raise BindingError(f"cannot bind the parameters of model chunk {index}: ddp_config.{flag} is "
                                   f"True. {why}.")


def _binding_name(name: str, chunk: int, n_chunks: int) -> str:
    return name if n_chunks == 1 else f"chunk{chunk}.{name}"


def _read_layout(chunks: list[Any]) -> ModelLayout:
    """Check the chunks and read the layout of their DDP buffers."""
    if not chunks:
        raise BindingError("bind_params needs at least one model chunk")
    _check_wrapped(chunks)
    _check_flags(chunks)
    try:
        return layout_of(chunks)
    except LayoutError as exc:
        raise BindingError(f"cannot read the DDP buffers: {exc}") from exc


def _buffer_params(buf: BufferLayout, named: dict[str, torch.nn.Parameter],
                   dtype: torch.dtype | None) -> list[tuple[Any, torch.nn.Parameter]]:
    """``(place, param)`` of the params of ``buf`` to bind (those of ``dtype`` only, when given)."""
    params = [(p, named[p.name]) for p in buf.params]
    if dtype is not None:  # a 0.4/0.5 buffer mixing dtypes keeps holes where the others are
        params = [(p, t) for p, t in params if t.dtype == dtype]
    dtypes = {t.dtype for _, t in params}
    if len(dtypes) > 1:
        raise BindingError(
            f"buffer {buf.key} mixes parameter dtypes {sorted(dtype_name(d) for d in dtypes)} (0.4/0.5 "
            f"group parameters by gradient dtype only); one flat buffer cannot hold them. Pass dtype= "
            f"to bind the parameters of one dtype (one bind_params call per dtype)."
        )
    return params


def _add_chunk(out: _Buffers, chunks: list[Any], chunk_index: int, layout: ModelLayout,
               dtype: torch.dtype | None) -> None:
    """Choose the flat buffers of one chunk (zero-copy ``param_data`` or a new tensor) and record its slots."""
    chunk = chunks[chunk_index]
    named = dict(unwrap(chunk).named_parameters())
    positions = {name: i for i, name in enumerate(named)}
    places = placements(unwrap(chunk))
    chunk_layouts = [b for b in layout.buffers if b.key.chunk == chunk_index]
    for (ddp_buffer, _), buf in zip(ddp_buffers(chunk, layout.version), chunk_layouts, strict=True):
        params = _buffer_params(buf, named, dtype)
        if not params:
            continue
        index = len(out.flats)
        param_data = getattr(ddp_buffer, "param_data", None) if buf.has_param_data else None
        if param_data is not None:
            out.flats.append(param_data)
            out.zero_copy.append(True)
        else:
            out.flats.append(torch.zeros(buf.numel, dtype=params[0][1].dtype, device=params[0][1].device))
            out.zero_copy.append(False)
        out.kept.append(buf)
        for p, param in params:
            out.slots.append(Slot(_binding_name(p.name, chunk_index, len(chunks)), p.name, chunk_index, param,
                                  index, p.start, tuple(p.shape), positions[p.name], places.get(p.name)))


def _unbound_names(chunks: list[Any], slots: list[Slot]) -> tuple[str, ...]:
    """Binding names of every parameter of the chunks that no slot holds."""
    bound_names = {(s.chunk, s.module_name) for s in slots}
    return tuple(_binding_name(name, c, len(chunks)) for c, chunk in enumerate(chunks)
                 for name, _ in unwrap(chunk).named_parameters() if (c, name) not in bound_names)


def _check_zero_copy(out: _Buffers) -> None:
    """Zero-copy parameters must be plain weights that live in DDP's ``param_data``."""
    flats, zero_copy, slots = out.flats, out.zero_copy, out.slots
    quantized = [s for s in slots if zero_copy[s.buffer] and s.param.dtype != flats[s.buffer].dtype]
    if quantized:
        raise BindingError(
            f"parameters {[s.name for s in quantized[:5]]} are stored as "
            f"{dtype_name(flats[quantized[0].buffer].dtype)} in DDP's "
            f"param_data but have another dtype (FP8/FP4 quantized parameters); their bytes are not plain "
            f"weights, so a flat view of them would be meaningless. Bind only the other buffers with dtype=."
        )
    by_place = {(s.buffer, s.offset): s.name for s in slots}
    stray = [f"{s.name}: {problem}" for s in slots if zero_copy[s.buffer]
             for problem in [place_problem(s, s.param, flats[s.buffer], by_place)] if problem]
    if stray:
        raise BindingError(
            "parameters no longer live in DDP's param buffer (param_data), where Megatron's distributed optimizer "
            "writes its updates; they were rebound after DDP was built and would never be updated:\n  "
            + "\n  ".join(stray[:20])
            + "\nRebuild the model and DDP without rebinding param.data (bind_params binds to param_data itself)."
        )


def _move_into_allocated(out: _Buffers) -> None:
    """Copy each parameter of an allocated buffer into its place and rebind its ``.data`` there."""
    with torch.no_grad():
        for s in out.slots:
            if out.zero_copy[s.buffer]:
                continue
            flat = out.flats[s.buffer]
            view = flat[s.offset:s.offset + numel(s.shape)]
            view.copy_(s.param.data.reshape(-1))
            s.param.data = view.view(s.shape)


def bind_params(model_chunks: Any, *, dtype: torch.dtype | None = None) -> ParamBinding:
    """Bind the trainable parameters of DDP-wrapped model chunks to flat buffers (see :mod:`mcore_compat.binding`).

    Args:
        model_chunks: one Megatron-Core ``DistributedDataParallel`` or a list of them (virtual pipeline chunks).
        dtype: bind only the parameters of this dtype (default: all); their buffers keep Megatron's layout.

    Returns:
        The binding. Names are those of the unwrapped module's ``named_parameters()`` with one chunk, and
        ``chunk<i>.<name>`` with several. Parameters of allocated buffers must own their storage: binding
        them again while an earlier allocated binding still holds them is refused (call its
        :meth:`~ParamBinding.unbind` first), and so is binding parameters pointed into a buffer of your own
        (bind first, then hand the binding's flat buffers to whoever reads the weights). Zero-copy bindings
        move nothing and can coexist. A refused call changes nothing.

    Raises:
        BindingError: a chunk is not DDP-wrapped; ``ddp_config.reuse_grad_buf_for_mxfp8_param_ag`` is set;
            parameters of a zero-copy buffer no longer live in it (rebound after DDP was built) or are quantized
            (FP8/FP4 storage); parameters of an allocated buffer do not own their storage (a view into a larger
            buffer: one of your own, or the flat buffer of an earlier binding not unbound); a 0.4/0.5 grad
            buffer mixes parameter dtypes and ``dtype`` is not given.
    """
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    layout = _read_layout(chunks)
    out = _Buffers()
    for chunk_index in range(len(chunks)):
        _add_chunk(out, chunks, chunk_index, layout, dtype)
    out.slots.sort(key=lambda s: (s.chunk, s.position))  # named_parameters() order, chunk by chunk
    # Re-index the layout to the bound buffers only (ManifestBuffer.chunk reads layout.buffers[i]).
    bound_layout = ModelLayout(tuple(out.kept), layout.unbuffered, layout.version)
    binding = ParamBinding(chunks, bound_layout, out.flats, out.zero_copy, out.slots,
                           _unbound_names(chunks, out.slots), coordinates())
    _check_zero_copy(out)
    check_own_storage(out.slots, out.zero_copy)
    _move_into_allocated(out)
    binding.verify()
    remember(binding)
    return binding
