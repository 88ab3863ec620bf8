"""The error of :mod:`mcore_compat.lifecycle`."""

from __future__ import annotations

from ..errors import McoreCompatError

__all__ = ["OffloadError"]


class OffloadError(McoreCompatError):
    """Model or optimizer memory cannot be offloaded (or reloaded) without losing or detaching something: a state
    :func:`~mcore_compat.lifecycle.offload` does not handle. The message names it and what to do instead."""
