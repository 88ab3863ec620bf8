"""Process groups per scenario case: a case that builds a model creates Megatron's groups (20-30 per
``initialize_model_parallel``; ``destroy_model_parallel`` only forgets them), and a module that runs many cases in
the session's ranks collected hundreds of live gloo groups (three threads each): measured on 0.19.2, the
checkpoint module's reshard case took 28.5 s after the earlier cases and 2.7 s with each case's groups destroyed.

Use: ``before = case_start()`` before a case; after it returned on this rank, ``case_end(before)``: a barrier
over the world (a rank whose case raised does its own barrier instead, so every rank does one per case) and the
groups created since ``before`` destroyed (the world group never).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def case_start() -> set[Any]:
    """The process groups this rank holds now."""
    from mcore_compat.launch import process_groups

    return process_groups()


def case_end(before: set[Any]) -> None:
    """After a case that returned on this rank: barrier, then the case's model parallelism and groups undone
    (:func:`mcore_compat.launch.destroy_model_parallel_since`)."""
    import torch.distributed as dist

    from mcore_compat.launch import destroy_model_parallel_since

    dist.barrier()
    destroy_model_parallel_since(before)


def run_case(fn: Callable[[], Any], **error: Any) -> Any:
    """``fn()`` between :func:`case_start` and :func:`case_end`; a case that raised gives ``{**error, "status":
    "error", "error": traceback}`` (this rank does its barrier alone, as every rank does one per case)."""
    import traceback

    import torch.distributed as dist

    before = case_start()
    try:
        result = fn()
    except Exception:
        dist.barrier()
        return {**error, "status": "error", "error": traceback.format_exc()}
    case_end(before)
    return result
