"""Process groups per scenario case: a case that builds a model creates Megatron's groups (20-30 per
``initialize_model_parallel``; ``destroy_model_parallel`` only forgets them), and a module that runs many cases in
the session's ranks collected hundreds of live gloo groups (three threads each): measured on 0.19.2, the
checkpoint module's reshard case took 28.5 s after the earlier cases and 2.7 s with each case's groups destroyed.

Use: ``before = case_start()`` before a case; after it returned on this rank, ``case_end(before)``: a barrier
over the world (a rank whose case raised does its own barrier instead, so every rank does one per case) and the
groups created since ``before`` destroyed (the world group never).
"""

from __future__ import annotations

from typing import Any


def case_start() -> set[Any]:
    """The process groups this rank holds now."""
    from mcore_compat.launch import process_groups

    return process_groups()


def case_end(before: set[Any]) -> None:
    """After a case that returned on this rank: barrier, ``destroy_model_parallel`` (Megatron forgets its groups,
    and destroys those it destroys itself: 0.9.0 destroys its gloo data-parallel group without asking whether it
    still exists, so it must go first), then destroy the groups the case created that are left."""
    import torch.distributed as dist

    from mcore_compat import symbols
    from mcore_compat.launch import destroy_process_groups_since

    dist.barrier()
    symbols.resolve("parallel_state").destroy_model_parallel()
    destroy_process_groups_since(before)
