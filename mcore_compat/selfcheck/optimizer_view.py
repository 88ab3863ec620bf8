"""Re-export of :mod:`mcore_compat._util.optimizer_view` (the main params of every optimizer layout), kept for imports."""

from .._util.optimizer_view import MainParam, OptimizerView, optimizer_view

__all__ = ["MainParam", "OptimizerView", "optimizer_view"]
