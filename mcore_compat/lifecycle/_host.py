"""Host copies of device storages: one buffer per storage, allocated on its first offload and reused after.

A storage is known by its ``StorageImpl`` (``untyped_storage()._cdata``), the object every view of it shares and
that ``resize_`` keeps. Each slot remembers the tensor it was found through (weakly: a slot whose tensor is gone,
or now on other storage, is dropped, and its host buffer kept as a spare for the next new storage of that size) and,
while the storage is offloaded, holds the storage itself, so that it cannot be freed and its key reused before it
is refilled. Host memory is therefore bounded by the bytes offloaded at once, cycle after cycle.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["HostSlot", "allocations", "buffers", "host_bytes", "release_host_buffers", "slot_for", "slots"]


@dataclass(eq=False)
class HostSlot:
    """The host copy of one storage.

    Attributes:
        key: the storage's ``_cdata``.
        anchor: a weak reference to a tensor on that storage.
        host: the host buffer (``uint8``, pinned when the storage is on CUDA).
        nbytes: the storage's size when it was offloaded.
        storage: the storage, while it is offloaded (``None`` otherwise).
        allocations: how many times :attr:`host` was allocated (1 unless the storage changed size).
    """

    key: int
    anchor: Any
    host: torch.Tensor | None = None
    nbytes: int = 0
    storage: Any = None
    allocations: int = 0

    @property
    def offloaded(self) -> bool:
        """Whether the storage is offloaded now (its bytes live only in :attr:`host`)."""
        return self.storage is not None

    def ensure_host(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """The host buffer: this slot's own when it has ``nbytes``, else a spare one of that size left by a storage
        that is gone (a main param's ``.grad`` re-created every step), else a new one (pinned for CUDA)."""
        if self.host is None or self.host.numel() != nbytes:
            if self.host is not None:
                _spare(self.host)
            pinned = device.type == "cuda"
            spares = _SPARE.get((nbytes, pinned))
            if spares:
                self.host = spares.pop()
            else:
                self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
                self.allocations += 1
                _COUNTS["allocations"] += 1
        return self.host


_SLOTS: dict[int, HostSlot] = {}
#: How many host buffers were allocated in this process.
_COUNTS = {"allocations": 0}
#: Host buffers of storages that are gone, by (bytes, pinned), for the next new storage of that size.
_SPARE: dict[tuple[int, bool], list[torch.Tensor]] = {}


def _spare(host: torch.Tensor) -> None:
    _SPARE.setdefault((host.numel(), host.is_pinned()), []).append(host)


def _drop(key: int) -> None:
    slot = _SLOTS.pop(key)
    if slot.host is not None:
        _spare(slot.host)


def _alive(slot: HostSlot) -> bool:
    tensor = slot.anchor()
    return slot.offloaded or (tensor is not None and tensor.untyped_storage()._cdata == slot.key)


def slot_for(tensor: torch.Tensor) -> HostSlot:
    """The slot of ``tensor``'s storage (created on first use; a stale one, whose tensor is gone, replaced)."""
    key = tensor.untyped_storage()._cdata
    slot = _SLOTS.get(key)
    if slot is None or not _alive(slot):
        if slot is not None:
            _drop(key)
        slot = HostSlot(key, weakref.ref(tensor))
        _SLOTS[key] = slot
    return slot


def slots() -> list[HostSlot]:
    """Every live slot (stale ones dropped)."""
    for key in [k for k, s in _SLOTS.items() if not _alive(s)]:
        _drop(key)
    return list(_SLOTS.values())


def allocations() -> int:
    """How many host buffers were allocated in this process (each storage's first offload, or a new size)."""
    return _COUNTS["allocations"]


def buffers() -> list[torch.Tensor]:
    """Every host buffer held now: those of live slots, then the spare ones."""
    return [s.host for s in slots() if s.host is not None] + [h for hs in _SPARE.values() for h in hs]


def host_bytes() -> int:
    """Bytes of host memory held by the host copies of offloaded (or once offloaded) storages.

    Returns:
        The sum of the sizes of every host buffer (spare ones, left by storages that are gone, included).
    """
    return sum(h.numel() for h in buffers())


def release_host_buffers() -> int:
    """Free the host buffers of storages that are not offloaded now (they are allocated again on the next
    offload). Storages still offloaded keep theirs: their bytes live there.

    Returns:
        The number of bytes released.
    """
    live = slots()  # first: the slots of storages that are gone drop their buffers into the spares, freed next
    freed = sum(h.numel() for spares in _SPARE.values() for h in spares)
    _SPARE.clear()
    for slot in live:
        if not slot.offloaded and slot.host is not None:
            freed += slot.host.numel()
            slot.host = None
    return freed
