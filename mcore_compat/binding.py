"""Bind every trainable parameter of DDP-wrapped model chunks to flat buffers, safely, on every release.

RL frameworks rebind ``param.data`` to views of one flat buffer so that weights can be broadcast to inference
engines with one collective. With Megatron-Core's distributed optimizer (0.6+) that silently freezes training:
DDP already moved every ``param.data`` into its own ``buffer.param_data`` and the optimizer writes its updates
there (all-gathered shards), never to ``param.data``; a param rebound elsewhere is never updated again.

:func:`bind_params` gives the flat view without that trap:

* **zero-copy** (a buffer that holds ``param_data``: distributed optimizer, 0.6+): the flat buffers *are*
  Megatron's ``param_data`` tensors; ``param.data`` is never touched.
* **allocated** (no parameter buffer: 0.4/0.5, or 0.6+ without the distributed optimizer): one flat tensor per
  DDP grad buffer, with the same grouping, order, offsets and padding as that grad buffer (read with
  :func:`~mcore_compat.layout.layout_of`); each ``param.data`` is rebound once into it, values copied exactly.
  Every optimizer in that situation (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``, the
  ``mcore_compat.legacy_optimizer`` for 0.4/0.5, plain and distributed) writes the update into the *current*
  ``param.data`` (in place, or a main -> model copy through ``param.data``), so binding before or after the
  optimizer is built both work (tests, every release 0.4.0-0.19.2: after the optimizer with FP32Optimizer,
  Float16Optimizer and the legacy optimizer, plain and distributed, fp32 and bf16; before it with fp32).

::

    from mcore_compat.binding import bind_params, gather_pipeline, gather_pipeline_flat

    chunks = mt.wrap_ddp(chunks, ddp_config=mt.DDPConfig(use_distributed_optimizer=True))
    optimizer = mt.get_megatron_optimizer(opt_config, chunks)
    binding = bind_params(chunks)             # zero-copy here: Megatron's own param_data
    ...train...
    binding.verify()                          # raises BindingError if someone rebound param.data
    weights = gather_pipeline(binding)        # {"stage0.<name>": tensor, ...} on every pipeline rank
    engine.load(binding.manifest().to_json(), binding.flat_buffers())
    for stage in gather_pipeline_flat(binding, reuse_buffers=True):   # flat buffers of every stage, no views
        engine.load(stage.manifest.to_json(), stage.buffers)

:meth:`ParamBinding.verify` checks the aliasing cheaply, :func:`gather_pipeline` gathers all pipeline stages'
weights with one collective per flat buffer per stage (:func:`gather_pipeline_flat`: the same, as flat buffers
plus manifests, without building per-parameter views), and :meth:`ParamBinding.unbind` gives every param its own
storage back.

Caveats (documented, not checked):

* Optimizers that keep master copies (fp32 main params of bf16/fp16 models, the legacy distributed optimizer's
  fp32 shards bound after it was built) do not see weights *written into* the flat buffers by you; call the
  optimizer's ``reload_model_params()`` after loading weights that way.
* With ``overlap_param_gather`` the all-gather of updated parameters is deferred to the next forward pass: the
  zero-copy buffers hold the old values of other ranks' shards until then.
* Params in no DDP buffer (frozen params; expert params on 0.4/0.5) are not bound; see
  :attr:`ParamBinding.unbound`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from functools import lru_cache
from types import TracebackType
from typing import Any, Final

import torch

from .errors import McoreCompatError
from .layout import LAYOUT_FACTS, LayoutError, ModelLayout, _ddp_buffers, _unwrap, layout_of

__all__ = [
    "BindingError",
    "Manifest",
    "ManifestBuffer",
    "ManifestEntry",
    "ParamBinding",
    "StageBuffers",
    "bind_params",
    "gather_pipeline",
    "gather_pipeline_flat",
]

#: Manifest format version (bumped when fields change).
MANIFEST_FORMAT: Final = 1

#: Names of the DDP attributes that hold buffers, over all releases (from the layout table).
_DDP_BUFFER_ATTRS: Final = frozenset(
    attr for _, attrs in LAYOUT_FACTS["ddp_buffer_attrs"] for attr in attrs if attr is not None
)

#: ``ddp_config`` flags under which ``param_data`` is no persistent home of the weights (flag -> why).
_ALIASING_INVALID_FLAGS: Final[dict[str, str]] = {
    "reuse_grad_buf_for_mxfp8_param_ag": (
        "DDP's param_data is then a transient view of the gradient buffer, used only during the parameter "
        "all-gather and zeroed afterwards; the weights live in TE's quantized storage. Build DDP with "
        "reuse_grad_buf_for_mxfp8_param_ag=False to bind the parameters"
    ),
}


class BindingError(McoreCompatError):
    """Parameters cannot be bound to flat buffers, or a binding is broken (see :meth:`ParamBinding.verify`)."""


# --------------------------------------------------------------------------------------------------------------
# Manifest
# --------------------------------------------------------------------------------------------------------------


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise BindingError(f"unknown dtype {name!r} in manifest")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@lru_cache(maxsize=4096)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape``, as ``torch.empty(shape).stride()`` gives them (sizes of 0 count as 1)."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(shape[i + 1], 1)
    return tuple(strides)


def _view(flat: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """``flat[offset:offset + numel].view(shape)`` of a contiguous ``flat``, in one ``as_strided`` call.

    Several times cheaper than slicing then viewing (one view instead of two, no shape inference); it aliases
    ``flat``'s storage the same way. ``flat`` must be contiguous (the flat buffers are; :meth:`Manifest.views`
    takes the slice-and-view path for others).
    """
    return flat.as_strided(shape, _contiguous_strides(shape), flat.storage_offset() + offset)


def _slice_view(flat: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """:func:`_view` for a flat tensor that is not contiguous (a strided 1-D tensor)."""
    return flat[offset:offset + _numel(shape)].view(shape)


@dataclass(frozen=True)
class ManifestBuffer:
    """One flat buffer of a binding.

    Attributes:
        index: position in :meth:`ParamBinding.flat_buffers`.
        chunk: model chunk the buffer belongs to.
        key: Megatron's buffer identity as text (:class:`~mcore_compat.layout.BufferKey`).
        dtype: element type (``"float32"``, ``"bfloat16"``, ...).
        numel: elements, padding included.
        zero_copy: the buffer is Megatron's own ``param_data`` (else allocated by :func:`bind_params`).
    """

    index: int
    chunk: int
    key: str
    dtype: str
    numel: int
    zero_copy: bool

    @property
    def torch_dtype(self) -> torch.dtype:
        """:attr:`dtype` as a ``torch.dtype``."""
        return _dtype_from_name(self.dtype)


@dataclass(frozen=True)
class ManifestEntry:
    """Where one parameter lives: ``flat_buffers()[buffer][offset:offset + numel].view(shape)``.

    Attributes:
        name: the name in the binding (see :func:`bind_params` for the naming rule).
        chunk: model chunk.
        buffer: index of the flat buffer.
        offset: first element in that buffer.
        shape: parameter shape.
        dtype: element type.
    """

    name: str
    chunk: int
    buffer: int
    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Manifest:
    """Names, shapes, dtypes and offsets of every bound parameter; JSON-serialisable.

    Attributes:
        buffers: the flat buffers, by index.
        params: the parameters in ``named_parameters()`` order (chunk by chunk; Megatron lays them out in
            reverse, so offsets descend within a buffer).
        version: the megatron-core release that built the model.
        format: :data:`MANIFEST_FORMAT`.
    """

    buffers: tuple[ManifestBuffer, ...]
    params: tuple[ManifestEntry, ...]
    version: str = ""
    format: int = MANIFEST_FORMAT

    def to_dict(self) -> dict[str, Any]:
        """Plain ``dict``/``list``/``str``/``int`` data (what :meth:`to_json` writes)."""
        out = asdict(self)
        for p in out["params"]:
            p["shape"] = list(p["shape"])
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Manifest:
        """Inverse of :meth:`to_dict`.

        Raises:
            BindingError: another manifest format, or missing fields.
        """
        fmt = int(data.get("format", -1))
        if fmt != MANIFEST_FORMAT:
            raise BindingError(f"manifest format {fmt} is not supported (this mcore_compat reads format "
                               f"{MANIFEST_FORMAT})")
        try:
            buffers = tuple(ManifestBuffer(**b) for b in data["buffers"])
            params = tuple(ManifestEntry(**{**p, "shape": tuple(int(s) for s in p["shape"])})
                           for p in data["params"])
        except (KeyError, TypeError) as exc:
            raise BindingError(f"malformed manifest: {exc}") from exc
        return cls(buffers, params, str(data.get("version", "")), fmt)

    def to_json(self, **kwargs: Any) -> str:
        """The manifest as JSON text (``kwargs`` go to ``json.dumps``)."""
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(text))

    def views(self, flat_buffers: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{name: view}`` of flat buffers laid out as this manifest says (e.g. buffers received from a peer).

        Raises:
            BindingError: the buffers do not match the manifest (count, dtype or size).
        """
        if len(flat_buffers) != len(self.buffers):
            raise BindingError(f"manifest describes {len(self.buffers)} flat buffer(s), got {len(flat_buffers)}")
        for b, t in zip(self.buffers, flat_buffers, strict=True):
            if t.dtype != b.torch_dtype or t.numel() != b.numel:
                raise BindingError(f"flat buffer {b.index}: expected {b.numel} x {b.dtype}, got "
                                   f"{t.numel()} x {_dtype_name(t.dtype)}")
        if all(t.is_contiguous() for t in flat_buffers):
            return {p.name: _view(flat_buffers[p.buffer], p.offset, p.shape) for p in self.params}
        return {p.name: _slice_view(flat_buffers[p.buffer], p.offset, p.shape) for p in self.params}


# --------------------------------------------------------------------------------------------------------------
# ParamBinding
# --------------------------------------------------------------------------------------------------------------


@dataclass
class _Slot:
    """One bound parameter."""

    name: str  # name in the binding
    module_name: str  # name in the chunk's unwrapped module
    chunk: int
    param: torch.nn.Parameter
    buffer: int
    offset: int
    shape: tuple[int, ...]
    position: int  # index in the chunk's named_parameters()


class ParamBinding:
    """Trainable parameters of DDP-wrapped model chunks bound to flat buffers. Made by :func:`bind_params`.

    Use as a context manager to :meth:`unbind` on exit.
    """

    def __init__(self, chunks: list[Any], layout: ModelLayout, flats: list[torch.Tensor], zero_copy: list[bool],
                 slots: list[_Slot], unbound: tuple[str, ...]) -> None:
        self._chunks = chunks
        self._layout = layout
        self._flats = flats
        self._zero_copy = zero_copy
        self._slots = slots
        self._unbound = unbound
        self._bound = True
        self._stage_manifests: dict[tuple[int, ...], list[Manifest]] = {}
        #: gather_pipeline_flat(reuse_buffers=True): receive buffers by (group ranks, stage).
        self._receive_buffers: dict[tuple[tuple[int, ...], int], list[torch.Tensor]] = {}
        self._by_place = {(s.buffer, s.offset): s.name for s in slots}

    # ------------------------------------------------------------------------------------------------- facts
    @property
    def bound(self) -> bool:
        """``False`` after :meth:`unbind`."""
        return self._bound

    @property
    def mode(self) -> str:
        """``"zero_copy"`` (all buffers are Megatron's ``param_data``), ``"allocated"``, ``"mixed"``, or
        ``"empty"`` (nothing bound, e.g. ``dtype=`` matched no buffer)."""
        if not self._zero_copy:
            return "empty"
        if all(self._zero_copy):
            return "zero_copy"
        return "allocated" if not any(self._zero_copy) else "mixed"

    @property
    def layout(self) -> ModelLayout:
        """The layout of the bound DDP buffers (``layout.buffers[i]`` is flat buffer ``i``)."""
        return self._layout

    @property
    def unbound(self) -> tuple[str, ...]:
        """Names of parameters that are not bound: in no DDP buffer (frozen; expert params on 0.4/0.5) or in a
        buffer left out by ``dtype=``."""
        return self._unbound

    def __len__(self) -> int:
        return len(self._slots)

    def __repr__(self) -> str:
        state = self.mode if self._bound else "unbound"
        return (f"ParamBinding({len(self._slots)} params in {len(self._flats)} flat buffer(s), {state}, "
                f"megatron-core {self._layout.version})")

    def _check_bound(self) -> None:
        if not self._bound:
            raise BindingError("the binding was unbound; call bind_params() again")

    # ------------------------------------------------------------------------------------------------- access
    def flat_buffers(self) -> list[torch.Tensor]:
        """The flat buffers, by manifest index (padding included; zero-copy buffers are Megatron's own)."""
        self._check_bound()
        return list(self._flats)

    def named_views(self) -> dict[str, torch.Tensor]:
        """``{name: view of the flat buffer}`` for every bound parameter, in ``named_parameters()`` order."""
        self._check_bound()
        flats = self._flats
        if all(f.is_contiguous() for f in flats):
            return {s.name: _view(flats[s.buffer], s.offset, s.shape) for s in self._slots}
        return {s.name: _slice_view(flats[s.buffer], s.offset, s.shape) for s in self._slots}

    def manifest(self) -> Manifest:
        """Names, shapes, offsets, dtypes and buffer indices (JSON-serialisable: :meth:`Manifest.to_json`)."""
        self._check_bound()
        buffers = tuple(
            ManifestBuffer(i, self._layout.buffers[i].key.chunk, str(self._layout.buffers[i].key),
                           _dtype_name(f.dtype), f.numel(), self._zero_copy[i])
            for i, f in enumerate(self._flats)
        )
        params = tuple(ManifestEntry(s.name, s.chunk, s.buffer, s.offset, s.shape,
                                     _dtype_name(self._flats[s.buffer].dtype)) for s in self._slots)
        return Manifest(buffers, params, self._layout.version)

    # ------------------------------------------------------------------------------------------------- verify
    def verify(self) -> None:
        """Check that every bound parameter's storage is at its offset of its flat buffer (no copies).

        Walks the chunks' ``named_parameters()`` once and compares data pointers, dtypes, shapes and contiguity.

        Raises:
            BindingError: naming every offending parameter: rebound outside the buffer, moved to another
                offset, at another parameter's place (wrong order / swapped), replaced by a new Parameter
                object, or gone.
        """
        self._check_bound()
        problems = self._problems()
        if problems:
            shown = problems[:20]
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise BindingError(
                f"{len(problems)} of {len(self._slots)} bound parameter(s) no longer live where the binding "
                f"put them:\n  " + "\n  ".join(shown) + more +
                "\nSomething rebound param.data after bind_params(). Updates written by Megatron's optimizer go "
                "to the flat buffers, so these parameters would silently stop training (or the flat buffers would "
                "not show them). Do not assign param.data; write into binding.named_views() instead."
            )

    def _problems(self) -> list[str]:
        by_name = {(s.chunk, s.module_name): s for s in self._slots}
        seen: set[int] = set()
        problems: list[str] = []
        for chunk_index, chunk in enumerate(self._chunks):
            for module_name, param in _unwrap(chunk).named_parameters():
                slot = by_name.get((chunk_index, module_name))
                if slot is None:
                    continue
                seen.add(id(slot))
                if param is not slot.param:
                    problems.append(f"{slot.name}: replaced by a new Parameter object after binding")
                    continue
                problem = self._place_problem(slot, param)
                if problem:
                    problems.append(f"{slot.name}: {problem}")
        problems.extend(f"{s.name}: no longer a parameter of chunk {s.chunk}" for s in self._slots
                        if id(s) not in seen)
        return problems

    def _place_problem(self, slot: _Slot, param: torch.Tensor) -> str | None:
        flat = self._flats[slot.buffer]
        data = param.data
        if data.dtype != flat.dtype:
            return f"dtype {_dtype_name(data.dtype)}, the flat buffer holds {_dtype_name(flat.dtype)}"
        if tuple(data.shape) != slot.shape:
            return f"shape {list(data.shape)}, expected {list(slot.shape)}"
        if data.numel() == 0:  # nothing to alias (an empty tensor may have no storage address)
            return None
        if data.device != flat.device:
            return f"on {data.device}, the flat buffer is on {flat.device}"
        if data.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
            return f"rebound outside flat buffer {slot.buffer} (own storage)"
        delta = data.data_ptr() - flat.data_ptr()
        size = flat.element_size()
        if delta != slot.offset * size:
            if delta % size:
                return f"at a misaligned byte offset {delta} of flat buffer {slot.buffer}"
            actual = delta // size
            other = self._by_place.get((slot.buffer, actual))
            where = f" (the place of {other}: wrong order / swapped)" if other else ""
            return f"at offset {actual} of flat buffer {slot.buffer}, expected {slot.offset}{where}"
        if data.numel() > 1 and not data.is_contiguous():
            return f"not contiguous (strides {list(data.stride())})"
        return None

    # ------------------------------------------------------------------------------------------------- unbind
    def unbind(self) -> None:
        """Give every parameter private storage again, weights exactly preserved; the binding becomes unusable.

        Zero-copy buffers: nothing was rebound, the params stay in Megatron's ``param_data`` (where DDP put
        them); only the binding's views are dropped. Allocated buffers: each ``param.data`` becomes its own
        copy. Calling it twice is a no-op.
        """
        if not self._bound:
            return
        with torch.no_grad():
            for slot in self._slots:
                if not self._zero_copy[slot.buffer]:
                    slot.param.data = slot.param.data.clone()
        self._bound = False
        self._flats = []
        self._stage_manifests.clear()
        self._receive_buffers.clear()

    def __enter__(self) -> ParamBinding:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.unbind()

    # ------------------------------------------------------------------------------------------------- stages
    def _manifests_over(self, group: Any) -> list[Manifest]:
        """Every member's manifest (one ``all_gather_object`` per group, cached)."""
        import torch.distributed as dist

        ranks = tuple(dist.get_process_group_ranks(group))
        if ranks not in self._stage_manifests:
            gathered: list[Any] = [None] * len(ranks)
            dist.all_gather_object(gathered, self.manifest().to_dict(), group=group)
            self._stage_manifests[ranks] = [Manifest.from_dict(m) for m in gathered]
        return self._stage_manifests[ranks]

    def _stage_receive_buffers(self, ranks: tuple[int, ...], stage: int, manifest: Manifest, device: torch.device,
                               reuse: bool) -> list[torch.Tensor]:
        """Buffers to receive ``stage``'s flat buffers into: fresh, or (``reuse``) cached from an earlier call."""
        if reuse:
            cached = self._receive_buffers.get((ranks, stage))
            if cached is not None and len(cached) == len(manifest.buffers) and all(
                    t.device == device and t.dtype == b.torch_dtype and t.numel() == b.numel
                    for t, b in zip(cached, manifest.buffers, strict=True)):
                return cached
        flats = [torch.empty(b.numel, dtype=b.torch_dtype, device=device) for b in manifest.buffers]
        if reuse:
            self._receive_buffers[(ranks, stage)] = flats
        return flats


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# --------------------------------------------------------------------------------------------------------------
# bind_params
# --------------------------------------------------------------------------------------------------------------


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


def bind_params(model_chunks: Any, *, dtype: torch.dtype | None = None) -> ParamBinding:
    """Bind the trainable parameters of DDP-wrapped model chunks to flat buffers (see the module docstring).

    Args:
        model_chunks: one Megatron-Core ``DistributedDataParallel`` or a list of them (virtual pipeline chunks).
        dtype: bind only the parameters of this dtype (default: all); their buffers keep Megatron's layout.

    Returns:
        The binding. Names are those of the unwrapped module's ``named_parameters()`` with one chunk, and
        ``chunk<i>.<name>`` with several. Binding the same chunks again re-allocates the allocated buffers (the
        earlier binding's :meth:`~ParamBinding.verify` then fails); zero-copy bindings can coexist.

    Raises:
        BindingError: a chunk is not DDP-wrapped; ``ddp_config.reuse_grad_buf_for_mxfp8_param_ag`` is set;
            parameters of a zero-copy buffer no longer live in it (rebound after DDP was built) or are quantized
            (FP8/FP4 storage); a 0.4/0.5 grad buffer mixes parameter dtypes and ``dtype`` is not given.
    """
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    if not chunks:
        raise BindingError("bind_params needs at least one model chunk")
    _check_wrapped(chunks)
    _check_flags(chunks)
    try:
        layout = layout_of(chunks)
    except LayoutError as exc:
        raise BindingError(f"cannot read the DDP buffers: {exc}") from exc

    flats: list[torch.Tensor] = []
    zero_copy: list[bool] = []
    slots: list[_Slot] = []
    kept = []
    for chunk_index, chunk in enumerate(chunks):
        named = dict(_unwrap(chunk).named_parameters())
        positions = {name: i for i, name in enumerate(named)}
        ddp_buffers = _ddp_buffers(chunk, layout.version)
        chunk_layouts = [b for b in layout.buffers if b.key.chunk == chunk_index]
        for (ddp_buffer, _), buf in zip(ddp_buffers, chunk_layouts, strict=True):
            params = [(p, named[p.name]) for p in buf.params]
            if dtype is not None:  # a 0.4/0.5 buffer mixing dtypes keeps holes where the others are
                params = [(p, t) for p, t in params if t.dtype == dtype]
            dtypes = {t.dtype for _, t in params}
            if len(dtypes) > 1:
                raise BindingError(
                    f"buffer {buf.key} mixes parameter dtypes {sorted(_dtype_name(d) for d in dtypes)} (0.4/0.5 "
                    f"group parameters by gradient dtype only); one flat buffer cannot hold them. Pass dtype= "
                    f"to bind the parameters of one dtype (one bind_params call per dtype)."
                )
            if not params:
                continue
            index = len(flats)
            param_data = getattr(ddp_buffer, "param_data", None) if buf.has_param_data else None
            if param_data is not None:
                flats.append(param_data)
                zero_copy.append(True)
            else:
                flats.append(torch.zeros(buf.numel, dtype=next(iter(dtypes)), device=params[0][1].device))
                zero_copy.append(False)
            kept.append(buf)
            for p, param in params:
                slots.append(_Slot(_binding_name(p.name, chunk_index, len(chunks)), p.name, chunk_index, param,
                                   index, p.start, tuple(p.shape), positions[p.name]))
    slots.sort(key=lambda s: (s.chunk, s.position))  # named_parameters() order, chunk by chunk
    # Re-index the layout to the bound buffers only (ManifestBuffer.chunk reads layout.buffers[i]).
    bound_layout = ModelLayout(tuple(kept), layout.unbuffered, layout.version)
    bound_names = {(s.chunk, s.module_name) for s in slots}
    unbound = tuple(_binding_name(name, c, len(chunks)) for c, chunk in enumerate(chunks)
                    for name, _ in _unwrap(chunk).named_parameters() if (c, name) not in bound_names)
    binding = ParamBinding(chunks, bound_layout, flats, zero_copy, slots, unbound)

    quantized = [s for s in slots if zero_copy[s.buffer] and s.param.dtype != flats[s.buffer].dtype]
    if quantized:
        raise BindingError(
            f"parameters {[s.name for s in quantized[:5]]} are stored as "
            f"{_dtype_name(flats[quantized[0].buffer].dtype)} in DDP's "
            f"param_data but have another dtype (FP8/FP4 quantized parameters); their bytes are not plain "
            f"weights, so a flat view of them would be meaningless. Bind only the other buffers with dtype=."
        )
    stray = [f"{s.name}: {problem}" for s in slots if zero_copy[s.buffer]
             for problem in [binding._place_problem(s, s.param)] if problem]
    if stray:
        raise BindingError(
            "parameters no longer live in DDP's param buffer (param_data), where Megatron's distributed optimizer "
            "writes its updates; they were rebound after DDP was built and would never be updated:\n  "
            + "\n  ".join(stray[:20])
            + "\nRebuild the model and DDP without rebinding param.data (bind_params binds to param_data itself)."
        )
    with torch.no_grad():
        for s in slots:
            if zero_copy[s.buffer]:
                continue
            flat = flats[s.buffer]
            view = flat[s.offset:s.offset + _numel(s.shape)]
            view.copy_(s.param.data.reshape(-1))
            s.param.data = view.view(s.shape)
    binding.verify()
    return binding


# --------------------------------------------------------------------------------------------------------------
# gather_pipeline
# --------------------------------------------------------------------------------------------------------------


def _default_pipeline_group() -> Any:
    import importlib

    return importlib.import_module("megatron.core.parallel_state").get_pipeline_model_parallel_group()


@dataclass(frozen=True)
class StageBuffers:
    """One pipeline stage's flat buffers, as :func:`gather_pipeline_flat` returns them.

    Attributes:
        stage: the stage (group rank in the pipeline group).
        manifest: that stage's :class:`Manifest` (``buffers[i]`` is laid out as ``manifest.buffers[i]``).
        buffers: that stage's flat buffers, by manifest index: on its own stage the live flat buffers of the
            binding (:meth:`ParamBinding.flat_buffers`), on the others the buffers received from it.
    """

    stage: int
    manifest: Manifest
    buffers: list[torch.Tensor]

    def views(self) -> dict[str, torch.Tensor]:
        """``{name: view}`` of :attr:`buffers` (:meth:`Manifest.views`)."""
        return self.manifest.views(self.buffers)


def gather_pipeline_flat(binding: ParamBinding, *, dst: int | None = None, group: Any = None,
                         reuse_buffers: bool = False) -> list[StageBuffers]:
    """All pipeline stages' flat buffers and manifests, with one collective per flat buffer per stage.

    What :func:`gather_pipeline` moves, without building a view per parameter: the form to hand weights to an
    inference engine that loads flat buffers with a manifest (a model of ~2,000 small tensors spends more time
    on the views than on the bytes).

    Every member of ``group`` calls it. Stage ``s`` (the member with group rank ``s``) broadcasts each of its
    flat buffers over ``group`` (with ``dst``: sends it to ``dst`` only); the manifests are exchanged once with
    ``all_gather_object`` and cached on the binding. With tensor parallelism each TP rank gathers its own shards
    over its own pipeline group (parallel_state's default).

    Args:
        binding: this rank's binding (:func:`bind_params`).
        dst: group rank (pipeline stage) that receives; ``None``: every member receives.
        group: the pipeline-parallel group (default: parallel_state's).
        reuse_buffers: receive into buffers cached on the binding (allocated by the first call, one set per
            group and stage) instead of fresh ones. The tensors returned are then the same objects on every
            call, and **each call overwrites what the previous one returned**: copy what must outlive the next
            call. The cache is dropped by :meth:`ParamBinding.unbind`.

    Returns:
        One :class:`StageBuffers` per stage, in stage order: this stage's entry holds its live flat buffers, the
        others the received ones. An empty list on members other than ``dst``.

    Raises:
        BindingError: the binding was unbound, or ``dst`` is not a member of ``group``.
    """
    import torch.distributed as dist

    binding._check_bound()
    group = group if group is not None else _default_pipeline_group()
    ranks = tuple(dist.get_process_group_ranks(group))
    me = dist.get_rank(group)
    if dst is not None and not 0 <= dst < len(ranks):
        raise BindingError(f"dst={dst} is not a rank of the pipeline group (size {len(ranks)})")
    manifests = binding._manifests_over(group)
    if binding._flats:
        device = binding._flats[0].device
    elif dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    receive = dst is None or dst == me
    out: list[StageBuffers] = []
    for stage, (src, manifest) in enumerate(zip(ranks, manifests, strict=True)):
        if stage == me:
            flats = binding.flat_buffers()
        elif receive:
            flats = binding._stage_receive_buffers(ranks, stage, manifest, device, reuse_buffers)
        else:
            continue
        for flat in flats:
            if dst is None:
                dist.broadcast(flat, src=src, group=group)
            elif stage != me:
                dist.recv(flat, src=src, group=group)
            elif dst != me:
                dist.send(flat, dst=ranks[dst], group=group)
        if receive:
            out.append(StageBuffers(stage, manifest, flats))
    return out


def gather_pipeline(binding: ParamBinding, *, dst: int | None = None, group: Any = None) -> dict[str, torch.Tensor]:
    """All weights of all pipeline stages, with one collective per flat buffer per stage.

    Every member of ``group`` calls it. Stage ``s`` (the member with group rank ``s``) broadcasts each of its
    flat buffers over ``group`` (with ``dst``: sends it to ``dst`` only); the layouts are exchanged once with
    ``all_gather_object`` and cached on the binding. With tensor parallelism each TP rank gathers its own shards
    over its own pipeline group (parallel_state's default). :func:`gather_pipeline_flat` moves the same bytes
    and returns the flat buffers with their manifests instead of per-parameter views (cheaper for many small
    tensors, and it can receive into reused buffers).

    Args:
        binding: this rank's binding (:func:`bind_params`).
        dst: group rank (pipeline stage) that receives; ``None``: every member receives.
        group: the pipeline-parallel group (default: parallel_state's).

    Returns:
        ``{"stage<s>.<name>": tensor}`` for every stage ``s`` in order and every bound parameter of that stage
        (``<name>`` as in :meth:`ParamBinding.named_views`), i.e. the concatenation of each stage's
        ``named_parameters()`` made unique by the stage prefix. This stage's entries are views of its live flat
        buffers, the others views of freshly received buffers. Empty on members other than ``dst``.

    Raises:
        BindingError: the binding was unbound, or ``dst`` is not a member of ``group``.
    """
    out: dict[str, torch.Tensor] = {}
    for stage in gather_pipeline_flat(binding, dst=dst, group=group):
        prefix = f"stage{stage.stage}."
        out.update({prefix + name: t for name, t in stage.views().items()})
    return out
