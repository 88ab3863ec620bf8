"""The distributed optimizer's overlapped parameter all-gather (``overlap_param_gather``), finished on demand.

With ``overlap_param_gather`` the optimizer step updates only this rank's shard of every parameter buffer; the
all-gather that brings every rank's parameters up to date is dispatched and waited for by forward pre-hooks
during the next forward pass. Between steps (to read, check, save or hand off the weights) the gather has to be
finished explicitly. Who owns it drifted (the fact ``param_gather_owner``): the DistributedOptimizer with a
process-wide module pre-hook on 0.6-0.8 (``megatron/core/optimizer/distrib_optimizer.py``), DDP with per-module
pre-hooks from 0.9 (``megatron/core/distributed/distributed_data_parallel.py``).
"""

from __future__ import annotations

from typing import Any

from ..capabilities import fact
from ..errors import InvalidArgumentError
from ._common import as_chunk_list, installed_version

__all__ = ["finish_param_sync", "overlaps_param_gather"]

#: Attribute set by :func:`~mcore_compat.training.wrap_ddp` on chunks whose settings ask for
#: ``overlap_param_gather`` on releases where the optimizer, not DDP, owns the gather (0.6-0.8).
REQUEST_ATTR = "mcore_compat_overlap_param_gather"


def overlaps_param_gather(chunk: Any) -> bool:
    """Whether a DDP-wrapped chunk was built with the distributed optimizer and ``overlap_param_gather``."""
    cfg = getattr(chunk, "ddp_config", None)
    if cfg is not None and getattr(cfg, "overlap_param_gather", False):
        return bool(getattr(cfg, "use_distributed_optimizer", False))
    return bool(getattr(chunk, REQUEST_ATTR, False))


def _optimizers(optimizer: Any) -> list[Any]:
    """The optimizer and, for Megatron's ChainedOptimizer, the optimizers it chains."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def finish_param_sync(model_chunks: Any, optimizer: Any = None, *, keep_overlap: bool = True) -> bool:
    """Complete the overlapped parameter all-gather now, so that every parameter holds its updated value.

    Call after ``optimizer_step`` when the weights are needed before the next forward pass (to read, check,
    save or hand them off). A no-op without ``overlap_param_gather`` (the step gathered synchronously).

    Args:
        model_chunks: the DDP-wrapped chunks (a single module is accepted).
        optimizer: the optimizer from :func:`~mcore_compat.training.get_megatron_optimizer` (needed on 0.6-0.8,
            where it owns the gather).
        keep_overlap: ``True``: the next steps overlap the gather again. ``False`` (end of training): the forward
            pre-hooks that wait for the gather are removed, and later forwards use the weights as they are. On
            0.6-0.8 the optimizer's pre-hook is process-wide (it runs for every module of the process and keeps
            the optimizer alive), so remove it when done.

    Returns:
        Whether a gather was completed.
    """
    chunks, _ = as_chunk_list(model_chunks)
    if not any(overlaps_param_gather(c) for c in chunks):
        return False
    owner = fact("param_gather_owner", installed_version())
    if owner == "ddp":
        for chunk in chunks:
            if not overlaps_param_gather(chunk):
                continue
            if keep_overlap:
                chunk.start_param_sync(force_sync=True)
            else:
                chunk.disable_forward_pre_hook()  # removes DDP's hooks, then gathers synchronously
        return True
    if owner == "optimizer":
        if optimizer is None:
            raise InvalidArgumentError(
                "finish_param_sync needs the optimizer on this release (it owns the param gather)"
            )
        done = False
        for opt in _optimizers(optimizer):
            if getattr(opt, "overlap_param_gather", False):
                opt.disable_pre_hook()  # removes the pre-hook, then gathers every bucket synchronously
                if keep_overlap:
                    opt.enable_pre_hook()
                done = True
        return done
    return False
