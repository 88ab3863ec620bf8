"""Lifecycle of a training process's memory: offload and reload (RL colocation, where training and rollout share
the accelerators).

::

    import mcore_compat as mc

    mc.offload(chunks, optimizer)               # params, grads, optimizer state -> host; device memory freed
    ...                                         # rollout / inference on the same GPUs
    mc.reload(chunks, optimizer)                # same storages refilled in place; training continues bit for bit

    with mc.offloaded(chunks, optimizer, params=False):   # grads + optimizer only, params kept for weight sync
        ...

See :mod:`mcore_compat.lifecycle.offload`.
"""

from __future__ import annotations

from ._host import host_bytes, release_host_buffers
from .errors import OffloadError
from .offload import Moved, offload, offloaded, reload

__all__ = ["Moved", "OffloadError", "host_bytes", "offload", "offloaded", "release_host_buffers", "reload"]
