"""Where this rank sits in the parallel layout (read from Megatron's ``parallel_state`` when it is initialised)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
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


def coords(n_chunks: int) -> Coords:
    """This rank's :class:`Coords` (a single process when ``torch.distributed`` is not initialised)."""
    from .._util.rank_coords import read

    c = read()  # the one reader of parallel_state (binding.placement reads it too)
    return Coords(**{f.name: c[f.name] for f in fields(Coords) if f.name != "vpp"}, vpp=n_chunks)


def is_expert(param: Any) -> bool:
    """Megatron's mark of an expert-parallel param (``allreduce=False``, every release with MoE)."""
    return not getattr(param, "allreduce", True)
