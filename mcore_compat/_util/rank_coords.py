"""This rank's place in the parallel layout, read from Megatron's ``parallel_state``: the one reader behind the
binding's :class:`~mcore_compat.binding.placement.Coordinates` and the checkpoints'
:class:`~mcore_compat.checkpoint.coords.Coords` (each keeps the fields its own job needs)."""

from __future__ import annotations

from typing import Any

__all__ = ["read"]


def _call(ps: Any, name: str, default: int) -> int:
    fn = getattr(ps, name, None)
    if fn is None:
        return default
    try:
        return int(fn())
    except (AssertionError, AttributeError, TypeError):  # a group the job did not create (0.4: no experts)
        return default


def read() -> dict[str, int]:
    """Global ``rank`` and ``world`` size, and per parallel dimension this rank's index and the group's size:
    ``tp``/``tp_size``, ``pp``/``pp_size``, ``dp``/``dp_size``, ``ep``/``ep_size``, ``etp``/``etp_size`` (expert
    tensor parallelism: 0.11+ ``get_expert_tensor_parallel_*``; the TP rank and size before, where experts were
    split over the TP group).

    A single process when ``torch.distributed`` is not initialised; without model parallelism (not initialised,
    or no Megatron) every rank is a data-parallel replica (``dp = rank``, ``dp_size = world``).
    """
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if initialised else (0, 1)
    out = dict(rank=rank, world=world, tp=0, tp_size=1, pp=0, pp_size=1, dp=rank, dp_size=world, ep=0, ep_size=1,
               etp=0, etp_size=1)
    if not initialised:
        return out
    try:
        from .. import symbols

        ps = symbols.resolve("parallel_state")
        if not ps.model_parallel_is_initialized():
            return out
    except Exception:  # no Megatron (a binding built in a unit test)
        return out
    tp, tp_size = _call(ps, "get_tensor_model_parallel_rank", 0), _call(ps, "get_tensor_model_parallel_world_size", 1)
    out.update(tp=tp, tp_size=tp_size,
               pp=_call(ps, "get_pipeline_model_parallel_rank", 0),
               pp_size=_call(ps, "get_pipeline_model_parallel_world_size", 1),
               dp=_call(ps, "get_data_parallel_rank", 0), dp_size=_call(ps, "get_data_parallel_world_size", 1),
               ep=_call(ps, "get_expert_model_parallel_rank", 0),
               ep_size=_call(ps, "get_expert_model_parallel_world_size", 1),
               etp=_call(ps, "get_expert_tensor_parallel_rank", tp),
               etp_size=_call(ps, "get_expert_tensor_parallel_world_size", tp_size))
    return out
