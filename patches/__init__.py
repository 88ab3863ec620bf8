"""Runtime patches for Megatron-Core, each scoped to the releases it fixes (installed as ``mcore_compat.patches``).

Nothing here is applied on ``import mcore_compat``. Patches are applied explicitly::

    from mcore_compat import patches
    patches.apply_for("cpu")            # the CPU/gloo harness for the detected release (tests, --device cpu)
    patches.apply_for_device("cuda")    # everything a run on this device needs (what the self-check applies)
    patches.apply("fp8_noop")           # one patch by name; refused outside its versions
    patches.applied()                   # what is applied now (never a refused or skipped patch)
    patches.refusal("fp8_noop")         # why it would be refused here (range, changed Megatron code), or None
    patches.revert_all()                # undo, in reverse order

Purposes: ``"cpu"`` (run Megatron's own DDP/optimizer/schedule code on a CPU-only torch with gloo),
``"apex_less"`` (0.4-0.9 without NVIDIA apex), ``"te_less"`` (GPT on 0.4-0.7 without TransformerEngine),
``"upstream_bug"`` (known Megatron-Core bugs that are not specific to CPU).

A patch that changes Megatron code is verified before it is applied: the fingerprint of each code object it
replaces or wraps, in the installed release, must be one recorded for it in ``_fingerprints.py`` (generated from
the release wheels by ``scripts/fingerprint_patches.py``); if not, it is refused with a ``PatchRefusedError``.
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
    refusal,
    register,
    revert,
    revert_all,
    skipped,
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
    "refusal",
    "register",
    "revert",
    "revert_all",
    "skipped",
]

# Importing the modules registers their patches.
from . import _definitions  # noqa: F401
