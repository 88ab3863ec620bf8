"""Host copies of device storages: one buffer per storage, allocated on its first offload and reused after.

A storage is known by its ``StorageImpl`` (``untyped_storage()._cdata``), the object every view of it shares and
that ``resize_`` keeps. Each slot remembers the tensor it was found through (weakly: a slot whose tensor is gone is
dropped) and, while the storage is offloaded, holds the storage itself, so that it cannot be freed and its key
reused before it is refilled.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["HostSlot", "host_bytes", "release_host_buffers", "slot_for", "slots"]


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
        """The host buffer, allocated (pinned for CUDA storages) only if there is none of ``nbytes`` yet."""
        if self.host is None or self.host.numel() != nbytes:
            self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
            self.allocations += 1
        return self.host


_SLOTS: dict[int, HostSlot] = {}


def _alive(slot: HostSlot) -> bool:
    tensor = slot.anchor()
    return slot.offloaded or (tensor is not None and tensor.untyped_storage()._cdata == slot.key)


def slot_for(tensor: torch.Tensor) -> HostSlot:
    """The slot of ``tensor``'s storage (created on first use; a stale one, whose tensor is gone, replaced)."""
    key = tensor.untyped_storage()._cdata
    slot = _SLOTS.get(key)
    if slot is None or not _alive(slot):
        slot = HostSlot(key, weakref.ref(tensor))
        _SLOTS[key] = slot
    return slot


def slots() -> list[HostSlot]:
    """Every live slot (stale ones dropped)."""
    for key in [k for k, s in _SLOTS.items() if not _alive(s)]:
        del _SLOTS[key]
    return list(_SLOTS.values())


def host_bytes() -> int:
    """Bytes of host memory held by the host copies of offloaded (or once offloaded) storages.

    Returns:
        The sum of the sizes of every live host buffer.
    """
    return sum(s.host.numel() for s in slots() if s.host is not None)


def release_host_buffers() -> int:
    """Free the host buffers of storages that are not offloaded now (they are allocated again on the next
    offload). Storages still offloaded keep theirs: their bytes live there.

    Returns:
        The number of bytes released.
    """
    freed = 0
    for slot in slots():
        if not slot.offloaded and slot.host is not None:
            freed += slot.host.numel()
            slot.host = None
    return freed
