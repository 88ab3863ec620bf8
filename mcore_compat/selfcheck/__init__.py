"""The self-check as a Python API: ``mcore_compat.selfcheck.run(nproc=2) -> Report``.

It builds a small model through mcore_compat on the installed Megatron-Core, trains a few steps next to a
plain-PyTorch reference, and checks that every parameter changed, correctly (equal to the reference update),
in place (binding intact), identically on data-parallel ranks, with the right gradient norm (the finalize hook
installed) and a falling loss. :func:`check_training_step` runs the checks that need no reference on the
caller's own model, at start-up.
"""

from __future__ import annotations

from .options import FAULTS, SelfCheckOptions, UsageError
from .own_model import check_training_step
from .report import Check, Report
from .runner import run, run_sweep, standard_sweep

__all__ = ["FAULTS", "Check", "Report", "SelfCheckOptions", "UsageError", "check_training_step", "run", "run_sweep",
           "standard_sweep"]
