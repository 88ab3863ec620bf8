"""A binding: trainable parameters of DDP-wrapped model chunks bound to flat buffers, checked and undone.

:class:`ParamBinding` (made by :func:`~mcore_compat.binding.bind_params`) holds the flat buffers and where each
parameter lives in them; it gives views and a :class:`~.manifest.Manifest`, checks that every ``param.data`` is
still where it was put (:meth:`ParamBinding.verify`) and gives every parameter its own storage back
(:meth:`ParamBinding.unbind`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from .._util.own_math import own_tensor_math
from ..layout import ModelLayout
from ..layout.read import unwrap
from .errors import BindingError
from .manifest import Manifest, ManifestBuffer, ManifestEntry
from .placement import Coordinates, Placement
from .views import dtype_name, flat_view, slice_view

__all__ = ["ParamBinding", "Slot", "place_problem"]


@dataclass
class Slot:
    """One bound parameter: which parameter, and where :func:`~mcore_compat.binding.bind_params` put it."""

    name: str  # name in the binding
    module_name: str  # name in the chunk's unwrapped module
    chunk: int
    param: torch.nn.Parameter
    buffer: int
    offset: int
    shape: tuple[int, ...]
    position: int  # index in the chunk's named_parameters()
    placement: Placement | None = None  # where it sits in the single-rank model


class ParamBinding:
    """Trainable parameters of DDP-wrapped model chunks bound to flat buffers. Made by :func:`bind_params`.

    Use as a context manager to :meth:`unbind` on exit.
    """

    def __init__(self, chunks: list[Any], layout: ModelLayout, flats: list[torch.Tensor], zero_copy: list[bool],
                 slots: list[Slot], unbound: tuple[str, ...], coords: Coordinates | None = None) -> None:
        self._chunks = chunks
        self._coords = coords or Coordinates()
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
        #: gather_full's transfer plans by (group ranks, bucket bytes): (the manifests they came from, buckets).
        self._full_plans: dict[tuple[tuple[int, ...], int], tuple[list[Manifest], list[Any]]] = {}
        #: gather_full's receive tensors by (dtype, device), one bucket each, reused across calls.
        self._full_staging: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

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
            return {s.name: flat_view(flats[s.buffer], s.offset, s.shape) for s in self._slots}
        return {s.name: slice_view(flats[s.buffer], s.offset, s.shape) for s in self._slots}

    def manifest(self) -> Manifest:
        """Names, shapes, offsets, dtypes and buffer indices (JSON-serialisable: :meth:`Manifest.to_json`)."""
        self._check_bound()
        buffers = tuple(
            ManifestBuffer(i, self._layout.buffers[i].key.chunk, str(self._layout.buffers[i].key),
                           dtype_name(f.dtype), f.numel(), self._zero_copy[i])
            for i, f in enumerate(self._flats)
        )
        params = tuple(self._entry(s) for s in self._slots)
        return Manifest(buffers, params, self._layout.version)

    def _entry(self, s: Slot) -> ManifestEntry:
        c, pl = self._coords, s.placement
        dtype = dtype_name(self._flats[s.buffer].dtype)
        if pl is None:
            pl = Placement(s.module_name, False, -1, 1)
        expert = pl.expert is not None
        return ManifestEntry(
            s.name, s.chunk, s.buffer, s.offset, s.shape, dtype, full_name=pl.full_name, tp_split=pl.tp_split,
            partition_dim=pl.partition_dim, partition_stride=pl.partition_stride,
            tp_rank=c.etp_rank if expert else c.tp_rank, tp_size=c.etp_size if expert else c.tp_size,
            expert=pl.expert, ep_rank=c.ep_rank if expert else None,
            vp_stage=s.chunk if len(self._chunks) > 1 else None, pp_rank=c.pp_rank, tied_to=pl.tied_to)

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
            for module_name, param in unwrap(chunk).named_parameters():
                slot = by_name.get((chunk_index, module_name))
                if slot is None:
                    continue
                seen.add(id(slot))
                if param is not slot.param:
                    problems.append(f"{slot.name}: replaced by a new Parameter object after binding")
                    continue
                problem = place_problem(slot, param, self._flats[slot.buffer], self._by_place)
                if problem:
                    problems.append(f"{slot.name}: {problem}")
        problems.extend(f"{s.name}: no longer a parameter of chunk {s.chunk}" for s in self._slots
                        if id(s) not in seen)
        return problems

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
        self._full_plans.clear()
        self._full_staging.clear()

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


@own_tensor_math
def place_problem(slot: Slot, param: torch.Tensor, flat: torch.Tensor,
                  by_place: Mapping[tuple[int, int], str]) -> str | None:
    """What is wrong with where ``param``'s storage lives, for the binding slot ``slot`` (``None``: nothing).

    Args:
        slot: the place the binding gave the parameter.
        param: the parameter as the model holds it now.
        flat: flat buffer ``slot.buffer``.
        by_place: binding name of the parameter at each ``(buffer, offset)``, to name a swapped neighbour.

    Returns:
        A short description of the problem (another dtype, shape or device, own storage, another offset, not
        contiguous), or ``None`` when ``param.data`` is the view of ``flat`` the binding made.
    """
    data = param.data
    if data.dtype != flat.dtype:
        return f"dtype {dtype_name(data.dtype)}, the flat buffer holds {dtype_name(flat.dtype)}"
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
        other = by_place.get((slot.buffer, actual))
        where = f" (the place of {other}: wrong order / swapped)" if other else ""
        return f"at offset {actual} of flat buffer {slot.buffer}, expected {slot.offset}{where}"
    if data.numel() > 1 and not data.is_contiguous():
        return f"not contiguous (strides {list(data.stride())})"
    return None
