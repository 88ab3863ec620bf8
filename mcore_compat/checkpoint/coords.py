"""Where this rank sits in the parallel layout (read from Megatron's ``parallel_state`` when it is initialised)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Coords", "coords", "is_expert"]


@dataclass(frozen=True)
class Coords:
    """This rank's place: global rank and world size, and rank/size per parallel dimension.

    ``vpp`` is the number of model chunks (virtual pipeline stages) the rank holds.
    """

    rank: int = 0
    world: int = 1
    tp: int = 0
    tp_size: int = 1
    pp: int = 0
    pp_size: int = 1
    dp: int = 0
    dp_size: int = 1
    ep: int = 0
    ep_size: int = 1
    vpp: int = 1

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def layout(self) -> dict[str, int]:
        """The layout of the whole job (sizes only)."""
        return {"world": self.world, "tp": self.tp_size, "pp": self.pp_size, "dp": self.dp_size,
                "ep": self.ep_size, "vpp": self.vpp}


def _call(ps: Any, name: str, default: int) -> int:
    fn = getattr(ps, name, None)
    if fn is None:
        return default
    try:
        return int(fn())
    except (AssertionError, AttributeError, TypeError):  # a group the job did not create (0.4: no experts)
        return default


def coords(n_chunks: int) -> Coords:
    """This rank's :class:`Coords` (a single process when ``torch.distributed`` is not initialised)."""
    import importlib

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return Coords(vpp=n_chunks)
    ps = importlib.import_module("megatron.core.parallel_state")
    rank, world = dist.get_rank(), dist.get_world_size()
    if not ps.model_parallel_is_initialized():
        return Coords(rank=rank, world=world, dp=rank, dp_size=world, vpp=n_chunks)
    return Coords(
        rank=rank, world=world,
        tp=_call(ps, "get_tensor_model_parallel_rank", 0), tp_size=_call(ps, "get_tensor_model_parallel_world_size", 1),
        pp=_call(ps, "get_pipeline_model_parallel_rank", 0),
        pp_size=_call(ps, "get_pipeline_model_parallel_world_size", 1),
        dp=_call(ps, "get_data_parallel_rank", 0), dp_size=_call(ps, "get_data_parallel_world_size", 1),
        ep=_call(ps, "get_expert_model_parallel_rank", 0),
        ep_size=_call(ps, "get_expert_model_parallel_world_size", 1), vpp=n_chunks)


def is_expert(param: Any) -> bool:
    """Megatron's mark of an expert-parallel param (``allreduce=False``, every release with MoE)."""
    return not getattr(param, "allreduce", True)
