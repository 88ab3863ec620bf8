"""A warm start for CPU ranks: imported ONCE by a fork server (``Group(..., warm=("mcore_compat._util.warm_cpu",))``)
so that every rank forked from it starts with torch, the patches a CPU run needs and Megatron-Core already loaded.

Importing it does, in order, what a CPU rank's first job would do: import ``torch.distributed``, apply
``mcore_compat.patches.apply_for_device("cpu")`` (the stand-ins must precede Megatron's import) and import
``megatron.core`` with the submodules every training run loads. It never raises: a fork server ignores a failed
preload, so whatever could not be done here is done (and reported) by the rank that needs it. :data:`ERROR` says
what failed, :data:`SERVER_PID` which process did the work.
"""

from __future__ import annotations

import importlib
import os

#: The process that imported this module (for a warm group: the fork server, not the ranks).
SERVER_PID = os.getpid()
#: Why the warm-up stopped early (``None``: it did everything).
ERROR: str | None = None

#: Loaded after ``megatron.core`` when the release has them (0.4/0.5 have no ``megatron.core.optimizer``).
_SUBMODULES = ("megatron.core.models.gpt", "megatron.core.distributed", "megatron.core.optimizer",
               "megatron.core.pipeline_parallel")


def _warm() -> str | None:
    try:
        importlib.import_module("torch.distributed")
        from .. import patches

        patches.apply_for_device("cpu")
        importlib.import_module("megatron.core")
    except Exception as exc:  # no Megatron (the unit session), a refused patch: the rank will say it
        return f"{type(exc).__name__}: {exc}"
    for name in _SUBMODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
    return None


ERROR = _warm()
