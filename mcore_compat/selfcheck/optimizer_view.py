"""Re-export of :mod:`mcore_compat._optimizer_view` (the main params of every optimizer layout), kept for imports."""

from .._optimizer_view import MainParam, OptimizerView, optimizer_view

__all__ = ["MainParam", "OptimizerView", "optimizer_view"]
