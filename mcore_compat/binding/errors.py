"""The error of :mod:`mcore_compat.binding`."""

from __future__ import annotations

from ..errors import McoreCompatError

__all__ = ["BindingError"]


class BindingError(McoreCompatError):
    """Parameters cannot be bound to flat buffers, or a binding is broken (see :meth:`ParamBinding.verify`)."""
