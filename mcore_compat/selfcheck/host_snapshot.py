"""Part of the pre-step snapshot in pinned host memory: copied while the step's forward and backward run.

The update check needs the main params and optimizer state as they were before the step; on a GPU keeping all of
them beside the live ones costs 6 bytes per param byte of a bf16 model (fp32 main params, two fp32 moments).
Those values do not change from :meth:`~.verify.StepVerifier.before_step` until the optimizer step (the
fingerprints prove it), so a :class:`HostSnapshot` copies the chosen tensors to pinned host memory on a side
stream started there, overlapping the forward and backward; :meth:`HostSnapshot.fence` makes the step wait for
the copies. The update check reads them back block by block. Pinned buffers are reused from one snapshot to the
next (pinning gigabytes costs more than copying them); :func:`release_pinned` frees them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HostSnapshot", "release_pinned"]

#: pinned buffers of released snapshots, by (elements, dtype): reused by the next snapshot
_POOL: dict[tuple[int, Any], list[Any]] = {}


def release_pinned() -> None:
    """Free the pinned buffers kept for the next snapshot."""
    _POOL.clear()


def _pinned(numel: int, dtype: Any) -> Any:
    import torch

    free = _POOL.get((numel, dtype))
    if free:
        return free.pop()
    return torch.empty(numel, dtype=dtype, pin_memory=True)


class HostSnapshot:
    """Copies of device tensors in pinned host memory, taken on a side stream of ``device``."""

    def __init__(self, device: Any) -> None:
        import torch

        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.copies: dict[Any, Any] = {}
        self.event: Any = None

    def start(self, tensors: dict[Any, Any]) -> None:
        """Start copying ``tensors`` (``{key: device tensor}``), ordered after the work queued so far."""
        import torch

        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for key, t in tensors.items():
                host = _pinned(t.numel(), t.dtype)
                host.copy_(t.detach().reshape(-1), non_blocking=True)
                self.copies[key] = host
        self.event = self.stream.record_event()

    def fence(self) -> None:
        """Make the device's current stream (the optimizer step) wait until the copies are complete."""
        import torch

        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)

    def release(self) -> None:
        """Return the buffers to the pool (work queued after this call may reuse them)."""
        for host in self.copies.values():
            _POOL.setdefault((host.numel(), host.dtype), []).append(host)
        self.copies = {}
