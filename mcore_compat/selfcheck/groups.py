"""The process groups and pipeline position of one rank, and the plain point-to-point transfers the
reference and the replica checks use (no Megatron communication code)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .reference import dtype_code, dtype_of
from .wrappers import core_module

__all__ = ["Groups"]

#: Metadata sent ahead of a tensor: ndim, up to 6 dims, dtype code.
_META = 8


def _first_attr(obj: Any, *names: str) -> Any:
    for name in names:
        fn = getattr(obj, name, None)
        if fn is not None:
            return fn
    return None


class Groups:
    """This rank's groups (from Megatron's ``parallel_state``, which every release has) and pipeline position.

    Attributes:
        dp, tp_group, pp_group, edp: data-, tensor-, pipeline- and expert-data-parallel groups.
        dp_size, dp_rank, tp, tp_rank, pp, pp_rank, edp_size, edp_rank: their sizes and this rank's place.
        pp_ranks: the global ranks of this pipeline, stage by stage.
        device: where collectives' tensors live (CUDA for NCCL).
    """

    def __init__(self, device: Any) -> None:
        import torch.distributed as dist

        from .. import symbols

        ps = symbols.resolve("parallel_state")
        self.ps = ps
        self.device = device
        try:
            self.dp = ps.get_data_parallel_group(with_context_parallel=True)
        except TypeError:  # 0.4: no context parallelism
            self.dp = ps.get_data_parallel_group()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        edp = _first_attr(ps, "get_expert_data_parallel_group", "get_data_modulo_expert_parallel_group")
        try:
            self.edp = edp() if edp is not None else self.dp
        except (AssertionError, RuntimeError, TypeError):  # no expert groups built (dense model, older release)
            self.edp = self.dp
        self.dp_size, self.dp_rank = dist.get_world_size(self.dp), dist.get_rank(self.dp)
        self.tp, self.tp_rank = dist.get_world_size(self.tp_group), dist.get_rank(self.tp_group)
        self.pp, self.pp_rank = dist.get_world_size(self.pp_group), dist.get_rank(self.pp_group)
        self.edp_size, self.edp_rank = dist.get_world_size(self.edp), dist.get_rank(self.edp)
        self.pp_ranks: list[int] = list(dist.get_process_group_ranks(self.pp_group))
        self._vp_setter = getattr(ps, "set_virtual_pipeline_model_parallel_rank", None)
        self._vp_getter = getattr(ps, "get_virtual_pipeline_model_parallel_rank", None)
        self._vp_saved: Any = None

    # ------------------------------------------------------------------------------------------------ pipeline
    def local_stages(self, chunks: int) -> list[tuple[int, int]]:
        """``(stage, chunk)`` of this rank's (virtual) pipeline stages, in pipeline order (``chunks`` per rank)."""
        return [(s, s // self.pp) for s in range(self.pp * chunks) if s % self.pp == self.pp_rank]

    def stage_input(self, stage: int, requires_grad: bool) -> Any:
        """The activation ``stage`` receives from the stage before it (``None`` for the first stage)."""
        if stage == 0:
            return None
        x = self.recv_stage(stage - 1)
        return x.requires_grad_() if requires_grad else x

    def backward_stages(self, saved: dict[int, tuple[Any, Any]], stages: int,
                        after: Callable[[int], None] | None = None) -> None:
        """One micro-batch's backward through this rank's stages, last first (collective over the pipeline): the
        last stage backpropagates its output (the target), every other stage the gradient the next one sends back,
        and each sends its input's gradient to the stage before it. ``saved``: ``{stage: (input, output)}`` of
        the forward over :meth:`local_stages` (emptied); ``stages``: all (virtual) stages of the pipeline;
        ``after(chunk)``: called after each stage's backward."""
        import torch

        for stage in sorted(saved, reverse=True):
            chunk = stage // self.pp
            self.set_virtual_rank(chunk)
            x, y = saved.pop(stage)
            if stage == stages - 1:
                torch.autograd.backward(y)
            else:
                torch.autograd.backward(y, self.recv_stage(stage + 1, backward=True))
            if stage > 0:
                self.send_stage(x.grad, stage - 1, backward=True)
            if after is not None:
                after(chunk)

    def owner(self, stage: int) -> int:
        """Global rank holding (virtual) pipeline stage ``stage``."""
        return self.pp_ranks[stage % self.pp]

    def set_virtual_rank(self, chunk: int | None) -> None:
        """What the interleaved schedule does around each chunk's forward/backward (``None`` restores)."""
        if self._vp_setter is None or self._vp_getter is None:
            return
        if chunk is None:
            if self._vp_saved is not None:
                self._vp_setter(self._vp_saved[0])
                self._vp_saved = None
            return
        if self._vp_saved is None:
            self._vp_saved = (self._vp_getter(),)
        if self._vp_saved[0] is not None:  # only with virtual pipelining configured
            self._vp_setter(chunk)

    def send_stage(self, tensor: Any, to_stage: int, *, backward: bool = False) -> None:
        """Send ``tensor`` (an activation or its gradient) to the rank of ``to_stage``, metadata first."""
        self._send(tensor, self.owner(to_stage))

    def recv_stage(self, from_stage: int, *, backward: bool = False) -> Any:
        """Receive what :meth:`send_stage` sent from the rank of ``from_stage``."""
        return self._recv(self.owner(from_stage))

    def _send(self, tensor: Any, dst: int) -> None:
        import torch
        import torch.distributed as dist

        tensor = tensor.contiguous()
        meta = torch.zeros(_META, dtype=torch.int64, device=self.device)
        meta[0] = tensor.dim()
        meta[1:1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        meta[_META - 1] = dtype_code(tensor.dtype)
        dist.send(meta, dst)
        dist.send(tensor, dst)

    def _recv(self, src: int) -> Any:
        import torch
        import torch.distributed as dist

        meta = torch.zeros(_META, dtype=torch.int64, device=self.device)
        dist.recv(meta, src)
        shape = [int(s) for s in meta[1:1 + int(meta[0])].tolist()]
        out = torch.empty(shape, dtype=dtype_of(int(meta[_META - 1])), device=self.device)
        dist.recv(out, src)
        return out

    # ------------------------------------------------------------------------------------------------ tied
    def tied_weight(self, modules: Sequence[Any]) -> Any:
        """The weight this rank holds of an input-embedding/output-layer pair split over the first and last
        pipeline stage (``share_embeddings_and_output_weights``), else ``None``."""
        if self.pp < 2:
            return None
        if self.pp_rank == 0:
            core = core_module(modules[0])
        elif self.pp_rank == self.pp - 1:
            core = core_module(modules[-1])
        else:
            return None
        if not getattr(core, "share_embeddings_and_output_weights", False):
            return None
        getter = getattr(core, "shared_embedding_or_output_weight", None)
        return getter() if getter is not None else None

    def tied_partner(self) -> int:
        """Global rank holding the other copy of the tied weight."""
        return self.pp_ranks[-1] if self.pp_rank == 0 else self.pp_ranks[0]

    def exchange_tied(self, tensor: Any) -> Any:
        """Swap ``tensor`` with the other stage's copy (first stage sends first); returns the partner's."""
        partner = self.tied_partner()
        if self.pp_rank == 0:
            self._send(tensor, partner)
            return self._recv(partner)
        other = self._recv(partner)
        self._send(tensor, partner)
        return other

    # ------------------------------------------------------------------------------------------------ batch
    def tokens_over_batch(self, local_total: Any) -> Any:
        """Per-token loss: the number of tokens of the whole batch (the last stage's count, summed over DP)."""
        import torch
        import torch.distributed as dist

        t = torch.as_tensor(local_total, dtype=torch.float64, device=self.device).reshape(1).clone()
        if self.pp > 1:
            dist.broadcast(t, src=self.pp_ranks[-1], group=self.pp_group)
        if self.dp_size > 1:
            dist.all_reduce(t, group=self.dp)
        return float(t.item())
