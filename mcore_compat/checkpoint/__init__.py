"""Checkpoints that survive a Megatron-Core upgrade: save on one release, resume on another.

::

    import mcore_compat as mc

    mc.save_checkpoint("ckpt/step_100", chunks, optimizer, scheduler=sched, extra={"seen": n}, iteration=100)
    loaded = mc.load_checkpoint("ckpt/step_100", chunks, optimizer, scheduler=sched)   # in place, every rank
    loaded.iteration, loaded.extra

    mc.save_to_run("ckpt", 100, chunks, optimizer, scheduler=sched, keep_last=3)   # ckpt/iter_0000100 + tracker
    mc.load_checkpoint("ckpt", chunks, optimizer, scheduler=sched)                  # the newest complete one
    handle = mc.save_checkpoint_async("ckpt/step_200", chunks, optimizer)          # returns after the host copy
    handle.wait()                                                                   # every rank: publishes it
    handle = mc.save_to_run_async("ckpt", 300, chunks, optimizer, keep_last=3)    # the same, then the tracker

One format on every release (:mod:`.manifest`): per-rank torch files and a JSON manifest; the optimizer state is
stored per model parameter, so it reshards over data-parallel size (and, from the per-param TP record and the
per-stage layer record beside the manifest, over tensor- or pipeline-parallel size) and loads on other releases. A refusal
(:class:`CheckpointError` and its subclasses) happens before anything is written into the model or optimizer.
"""

from __future__ import annotations

from .errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointInProgressError,
    CheckpointMismatchError,
    CheckpointReshardError,
)
from .inspect import inspect_checkpoint
from .load import LoadedCheckpoint, load_checkpoint
from .manifest import FORMAT, Manifest, read_manifest
from .runs import RunCheckpoint, latest_checkpoint, run_checkpoints, save_to_run, save_to_run_async
from .save import SaveHandle, save_checkpoint, save_checkpoint_async

__all__ = ["FORMAT", "CheckpointError", "CheckpointFormatError", "CheckpointInProgressError",
           "CheckpointMismatchError", "CheckpointReshardError", "LoadedCheckpoint", "Manifest", "RunCheckpoint", "SaveHandle",
           "inspect_checkpoint", "latest_checkpoint", "load_checkpoint", "read_manifest", "run_checkpoints",
           "save_checkpoint", "save_checkpoint_async", "save_to_run", "save_to_run_async"]
