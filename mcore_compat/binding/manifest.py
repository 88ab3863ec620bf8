"""The manifest of a binding: names, shapes, dtypes and offsets of every bound parameter, as plain data.

A :class:`Manifest` is what a peer (an inference engine, another pipeline stage) needs to read flat buffers it
received: it serialises to JSON (:meth:`Manifest.to_json`) and builds views of buffers laid out as it says
(:meth:`Manifest.views`). This module needs ``torch`` for dtypes and views only: no process group, no Megatron.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Final

import torch

from .._util.deprecated import warn_deprecated_name
from .errors import BindingError
from .views import dtype_from_name, dtype_name, flat_view, slice_view

__all__ = ["MANIFEST_FORMAT", "Manifest", "ManifestBuffer", "ManifestEntry"]

#: Manifest format version (bumped when fields change): 2 adds where each parameter sits in the single-rank model
#: (:class:`ManifestEntry` ``full_name`` ... ``tied_to``); version 1 manifests are still read (those fields unset).
MANIFEST_FORMAT: Final = 2
#: Every format :meth:`Manifest.from_dict` reads.
READABLE_FORMATS: Final = (1, 2)


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
        return dtype_from_name(self.dtype)


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
        full_name: (format 2) its name in the unwrapped single-rank model (TP = PP = EP = 1: layer and expert
            numbers global); ``None`` in a version 1 manifest.
        tp_split: (2) Megatron's ``tensor_model_parallel``: a shard of ``full_name`` (False: duplicated over TP).
        partition_dim: (2) the dimension split over TP (``-1`` when not split).
        partition_stride: (2) TP rank r holds pieces r, r+tp, ... of ``tp*stride`` pieces along that dimension.
        tp_rank: (2) the tensor-parallel rank of the shard (the expert-TP rank for experts where it differs).
        tp_size: (2) the tensor-parallel size (the expert-TP size for experts).
        expert: (2) global expert index of an expert's parameter, ``None`` for dense ones.
        ep_rank: (2) expert-parallel rank of the rank that holds an expert's parameter, else ``None``.
        vp_stage: (2) virtual pipeline stage (model chunk) when the binding has several chunks, else ``None``.
        pp_rank: (2) pipeline stage of the rank.
        tied_to: (2) the single-rank name this parameter is a tied copy of (the last stage's output layer of a
            model sharing it with the input embedding), else ``None``.
    """

    name: str
    chunk: int
    buffer: int
    offset: int
    shape: tuple[int, ...]
    dtype: str
    full_name: str | None = None
    tp_split: bool = False
    partition_dim: int = -1
    partition_stride: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    expert: int | None = None
    ep_rank: int | None = None
    vp_stage: int | None = None
    pp_rank: int = 0
    tied_to: str | None = None

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
        format_version: :data:`MANIFEST_FORMAT` (the JSON key ``format_version``; manifests written before it was
            named so carry it as ``format``, which :meth:`from_dict` still reads). Version 1 manifests (no
            single-rank placement) are read with the format-2 fields unset.
    """

    buffers: tuple[ManifestBuffer, ...]
    params: tuple[ManifestEntry, ...]
    version: str = ""
    format_version: int = MANIFEST_FORMAT

    @property
    def format(self) -> int:
        """Deprecated name of :attr:`format_version` (warns once)."""
        warn_deprecated_name("mcore_compat.binding.manifest.Manifest.format")
        return self.format_version

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
            BindingError: another manifest format, or missing fields (a version 1 manifest with format-2 fields
                is malformed too).
        """
        fmt = int(data.get("format_version", data.get("format", -1)))
        if fmt not in READABLE_FORMATS:
            raise BindingError(f"manifest format_version {fmt} is not supported (this mcore_compat reads "
                               f"format_version {', '.join(map(str, READABLE_FORMATS))}); upgrade mcore_compat "
                               f"to read it")
        v1_fields = {"name", "chunk", "buffer", "offset", "shape", "dtype"}
        if fmt == 1 and any(set(p) - v1_fields for p in data.get("params", ()) if isinstance(p, Mapping)):
            raise BindingError("malformed manifest: format_version 1 with format-2 fields")
        if fmt == 2 and any(isinstance(p, Mapping) and "full_name" not in p for p in data.get("params", ())):
            raise BindingError("malformed manifest: format_version 2 entry without full_name")
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
                                   f"{t.numel()} x {dtype_name(t.dtype)}")
        if all(t.is_contiguous() for t in flat_buffers):
            return {p.name: flat_view(flat_buffers[p.buffer], p.offset, p.shape) for p in self.params}
        return {p.name: slice_view(flat_buffers[p.buffer], p.offset, p.shape) for p in self.params}
