"""Runtime patches for Megatron-Core, each scoped to the releases it fixes (installed as ``mcore_compat.patches``).

Nothing here is applied on ``import mcore_compat``. Patches are applied explicitly::

    from mcore_compat import patches
    patches.apply_for("cpu")            # the CPU/gloo harness for the detected release (tests, --device cpu)
    patches.apply_for_device("cuda")    # everything a run on this device needs (what the self-check applies)
    patches.apply("fp8_noop")           # one patch by name; refused outside its versions
    patches.applied()                   # what is applied now
    patches.revert_all()                # undo, in reverse order

Purposes: ``"cpu"`` (run Megatron's own DDP/optimizer/schedule code on a CPU-only torch with gloo),
``"apex_less"`` (0.4-0.9 without NVIDIA apex), ``"te_less"`` (GPT on 0.4-0.7 without TransformerEngine),
``"upstream_bug"`` (known Megatron-Core bugs that are not specific to CPU).
"""

from __future__ import annotations

from ._registry import (
    PURPOSES,
    Patch,
    applicable,
    applied,
    apply,
    apply_for,
    apply_for_device,
    get,
    list_patches,
    patched,
    purposes_for_device,
    register,
    revert,
    revert_all,
)

__all__ = [
    "PURPOSES",
    "Patch",
    "applicable",
    "applied",
    "apply",
    "apply_for",
    "apply_for_device",
    "get",
    "list_patches",
    "patched",
    "purposes_for_device",
    "register",
    "revert",
    "revert_all",
]

# Importing the modules registers their patches.
from . import _definitions  # noqa: F401
