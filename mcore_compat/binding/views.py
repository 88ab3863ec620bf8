"""Views of flat buffers and dtype names: the small tensor helpers that manifests and bindings share."""

from __future__ import annotations

from functools import lru_cache

import torch

from .errors import BindingError

__all__ = ["contiguous_strides", "dtype_from_name", "dtype_name", "flat_view", "numel", "slice_view"]


def dtype_from_name(name: str) -> torch.dtype:
    """The ``torch.dtype`` called ``name`` (``"bfloat16"`` -> ``torch.bfloat16``), as manifests write it.

    Raises:
        BindingError: ``name`` is no torch dtype.
    """
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise BindingError(f"unknown dtype {name!r} in manifest")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The name manifests write for ``dtype`` (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).replace("torch.", "")


@lru_cache(maxsize=4096)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape``, as ``torch.empty(shape).stride()`` gives them (sizes of 0 count as 1)."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(shape[i + 1], 1)
    return tuple(strides)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (cached), as ``torch.empty(shape).stride()`` gives them."""
    return _contiguous_strides(shape)


def flat_view(flat: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """``flat[offset:offset + numel].view(shape)`` of a contiguous ``flat``, in one ``as_strided`` call.

    Several times cheaper than slicing then viewing (one view instead of two, no shape inference); it aliases
    ``flat``'s storage the same way. ``flat`` must be contiguous (the flat buffers are; :meth:`~.manifest.Manifest.views`
    takes the slice-and-view path for others).
    """
    return flat.as_strided(shape, _contiguous_strides(shape), flat.storage_offset() + offset)


def slice_view(flat: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """:func:`flat_view` for a flat tensor that is not contiguous (a strided 1-D tensor)."""
    return flat[offset:offset + numel(shape)].view(shape)


def numel(shape: tuple[int, ...]) -> int:
    """Number of elements of a tensor of ``shape`` (1 for ``()``)."""
    n = 1
    for s in shape:
        n *= s
    return n
