"""Offload and reload the memory of DDP-wrapped model chunks and their optimizer, in place.

:func:`offload` copies params, grads and optimizer state into host buffers and frees their device memory;
:func:`reload` brings the same bytes back into the same storages; :func:`offloaded` does both around a block.
Storages are resized, never replaced (see :mod:`mcore_compat.lifecycle._storage`), so params keep aliasing DDP's
buffers, ``main_grad`` views and a binding's views stay valid, and training continues bit for bit. Host buffers
(pinned for CUDA) are allocated on the first offload of a storage and reused by every later cycle.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from . import _storage
from ._collect import PIECES, StorageGroup, collect
from ._host import slot_for, slots

__all__ = ["Moved", "offload", "offloaded", "reload"]


@dataclass(frozen=True)
class Moved:
    """Bytes moved by one :func:`offload` or :func:`reload`, per piece.

    Attributes:
        params: bytes of parameter storage (DDP's ``param_data``, params outside a buffer, frozen params) and of
            the modules' non-parameter buffers.
        grads: bytes of gradient storage (``grad_data``, ``main_grad`` outside a buffer, main params' grads).
        optimizer_state: bytes of the optimizer's main params and state (Adam moments, ...).
    """

    params: int = 0
    grads: int = 0
    optimizer_state: int = 0

    @property
    def total(self) -> int:
        """All bytes moved."""
        return self.params + self.grads + self.optimizer_state


def _wanted(params: bool, grads: bool, optimizer_state: bool) -> set[str]:
    return {piece for piece, on in zip(PIECES, (params, grads, optimizer_state), strict=True) if on}


def _groups(chunks: Any, optimizer: Any, wanted: set[str]) -> list[StorageGroup]:
    return [g for g in collect(chunks, optimizer, wanted) if g.piece in wanted]


def _moved(sizes: dict[str, int]) -> Moved:
    return Moved(**sizes)


def offload(chunks: Any, optimizer: Any = None, *, params: bool = True, grads: bool = True,
            optimizer_state: bool = True, empty_cache: bool = True) -> Moved:
    """Move the chosen pieces of the model chunks and the optimizer to host memory and free their device memory.

    Every storage is copied into its host buffer (allocated on its first offload, reused later) and resized to 0
    bytes. Offloading what is already offloaded does nothing. Call it between steps, with no communication in
    flight (an overlapped param all-gather finished first: ``training.finish_param_sync``); until :func:`reload`,
    do not run the model or the optimizer.

    Args:
        chunks: a model chunk wrapped in Megatron-Core's ``DistributedDataParallel``, or a list of them.
        optimizer: its optimizer (``get_megatron_optimizer``'s result, chained or not; mcore_compat's legacy
            optimizer on 0.4/0.5), or ``None``.
        params: offload the params (DDP's ``param_data`` with the distributed optimizer, every param's storage
            otherwise, frozen params included) and the modules' buffers that are not parameters.
        grads: offload the gradient buffers and ``main_grad`` tensors.
        optimizer_state: offload the optimizer's fp32 main params and its state (Adam moments).
        empty_cache: on CUDA, hand the freed memory back to the driver (``torch.cuda.empty_cache()``), so that
            another process (an inference engine) can use it; ``False`` keeps it in PyTorch's caching allocator.

    Returns:
        The bytes offloaded, per piece.

    Raises:
        OffloadError: a state that cannot be moved in place (FP8 parameter storage, NCCL user buffers, a
            precision-aware optimizer, memory not allocated by torch); nothing is moved then.
    """
    wanted = _wanted(params, grads, optimizer_state)
    groups = _groups(chunks, optimizer, wanted)
    slots()  # storages gone since the last offload leave their host buffers as spares
    sizes = dict.fromkeys(PIECES, 0)
    todo = []
    for group in groups:
        anchor = group.tensors[0]
        slot = slot_for(anchor)
        if slot.offloaded or anchor.untyped_storage().nbytes() == 0:
            continue
        todo.append((slot, anchor))
        sizes[group.piece] += _storage.copy_out(slot, anchor)
    devices = {anchor.device for _, anchor in todo}
    _storage.synchronize(devices)
    for slot, anchor in todo:
        _storage.release(slot, anchor)
    if empty_cache:
        _storage.empty_cache(devices)
    return _moved(sizes)


def reload(chunks: Any, optimizer: Any = None, *, params: bool = True, grads: bool = True,
           optimizer_state: bool = True) -> Moved:
    """Bring back what :func:`offload` moved: every offloaded storage of the chosen pieces is resized back and
    refilled with its bytes, in place (the same storage objects: nothing is rebound).

    Args:
        chunks: the model chunks given to :func:`offload`.
        optimizer: the optimizer given to :func:`offload` (or ``None``).
        params: reload the params.
        grads: reload the grads (their values as they were at offload).
        optimizer_state: reload the optimizer's main params and state.

    Returns:
        The bytes reloaded, per piece (0 for what was not offloaded).

    Raises:
        OffloadError: as :func:`offload`.
    """
    wanted = _wanted(params, grads, optimizer_state)
    sizes = dict.fromkeys(PIECES, 0)
    devices: set[torch.device] = set()
    for group in _groups(chunks, optimizer, wanted):
        slot = slot_for(group.tensors[0])
        if not slot.offloaded:
            continue
        sizes[group.piece] += _storage.refill(slot, group.tensors)
        devices.add(group.tensors[0].device)
    _storage.synchronize(devices)
    return _moved(sizes)


@contextmanager
def offloaded(chunks: Any, optimizer: Any = None, *, params: bool = True, grads: bool = True,
              optimizer_state: bool = True) -> Iterator[Moved]:
    """Offload on entry, reload on exit (also when the block raises)::

        with mcore_compat.offloaded(chunks, optimizer, params=False):   # keep params for weight sync
            engine.generate(...)

    Args:
        chunks, optimizer, params, grads, optimizer_state: as :func:`offload`.

    Yields:
        What :func:`offload` moved.

    Raises:
        OffloadError: as :func:`offload` (raised on entry, before anything is moved).
    """
    moved = offload(chunks, optimizer, params=params, grads=grads, optimizer_state=optimizer_state)
    try:
        yield moved
    finally:
        reload(chunks, optimizer, params=params, grads=grads, optimizer_state=optimizer_state)

