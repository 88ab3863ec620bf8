"""The self-check as a Python API: ``mcore_compat.selfcheck.run(nproc=2) -> Report``.

It builds a small model through mcore_compat on the installed Megatron-Core, trains a few steps next to a
plain-PyTorch reference, and checks that every parameter changed, correctly (equal to the reference update),
in place (binding intact), identically on data-parallel ranks, with the right gradient norm (the finalize hook
installed) and a falling loss.
"""

from __future__ import annotations

from .options import FAULTS, SelfCheckOptions, UsageError
from .report import Check, Report
from .runner import run, run_sweep, standard_sweep

__all__ = ["FAULTS", "Check", "Report", "SelfCheckOptions", "UsageError", "run", "run_sweep", "standard_sweep"]
