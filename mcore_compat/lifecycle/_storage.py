"""Moving one storage's bytes to its host buffer and back, in place.

Offload copies the storage into its host buffer and resizes the storage to 0 bytes; reload resizes the same
storage back and copies the bytes in. The ``StorageImpl`` is never replaced, so every view of it (params aliasing
DDP's ``param_data``, ``main_grad`` aliasing ``grad_data``, buckets, optimizer shards, a binding's views) is valid
again after reload. Rebinding ``tensor.data`` to fresh memory instead is the failure this avoids: the tensor would
no longer alias what Megatron updates.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._host import HostSlot
from .errors import OffloadError

__all__ = ["copy_out", "empty_cache", "refill", "release", "synchronize"]


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _non_blocking(device: torch.device) -> bool:
    return device.type == "cuda"


def copy_out(slot: HostSlot, tensor: torch.Tensor) -> int:
    """Copy the storage of ``tensor`` into its host buffer (allocated on the first call only).

    Args:
        slot: the storage's slot.
        tensor: a tensor on the storage.

    Returns:
        The bytes copied.

    Raises:
        OffloadError: the storage cannot be resized: memory not allocated by torch (``torch.from_numpy``), or
            memory a NumPy array was made a view of (``tensor.numpy()`` marks the storage not resizable, for
            good: numpy keeps a pointer into it).
    """
    storage = tensor.untyped_storage()
    if not storage.resizable():
        raise OffloadError(
            f"a {tuple(tensor.shape)} {tensor.dtype} tensor's storage is not resizable - memory torch did not "
            "allocate, or memory .numpy() was called on (torch then keeps it in place for numpy's sake) - so it "
            "cannot be freed in place; call .numpy() on a copy (t.detach().clone().numpy()), or keep it resident"
        )
    nbytes = storage.nbytes()
    host = slot.ensure_host(nbytes, storage.device)
    host.copy_(_bytes(storage), non_blocking=_non_blocking(storage.device))
    slot.nbytes = nbytes
    return nbytes


def release(slot: HostSlot, tensor: torch.Tensor) -> None:
    """Resize the storage of ``tensor`` to 0 bytes (after :func:`copy_out` and :func:`synchronize`)."""
    storage = tensor.untyped_storage()
    slot.storage = storage
    storage.resize_(0)


def refill(slot: HostSlot, tensors: Sequence[torch.Tensor]) -> int:
    """Resize the offloaded storage back and copy its bytes in from the host buffer.

    Args:
        slot: the storage's slot (offloaded).
        tensors: the tensors found on the storage (unused: every view follows the storage itself).

    Returns:
        The bytes copied.
    """
    storage = slot.storage
    assert slot.host is not None and storage is not None
    storage.resize_(slot.nbytes)
    _bytes(storage).copy_(slot.host, non_blocking=_non_blocking(storage.device))
    slot.storage = None
    return slot.nbytes


def synchronize(devices: set[torch.device]) -> None:
    """Wait for the asynchronous copies to and from CUDA devices (nothing to wait for elsewhere)."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def empty_cache(devices: set[torch.device]) -> None:
    """Return the freed blocks of CUDA devices to the driver (for another process or allocator to use)."""
    if any(device.type == "cuda" for device in devices):
        torch.cuda.empty_cache()
