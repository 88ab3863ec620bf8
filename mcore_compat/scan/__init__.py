"""Read a codebase's Megatron-Core imports statically and say, per release, which import raw, which moved
(reachable through the mirror :mod:`mcore_compat.core`), which are absent, and which mcore_compat adapts; rewrite
the import lines to the mirror (``mcore-compat scan PATH [--fix] [--check]``).

* :mod:`.read`: the imports and attribute uses of one file (``ast``);
* :mod:`.report`: the scan of a tree and its classification per release (:mod:`mcore_compat.surface`);
* :mod:`.adapters`: the names mcore_compat adapts by signature and the call to use;
* :mod:`.fix`: the rewrite (libcst, the ``scan`` extra).
"""

from __future__ import annotations

from .adapters import ADAPTERS, adapter_for
from .report import Scan, classify, render, scan_paths

__all__ = ["ADAPTERS", "Scan", "adapter_for", "classify", "render", "scan_paths"]
