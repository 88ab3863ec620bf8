"""Start every data-parallel replica from the same weights: ``broadcast_params`` on every release (0.4 ... 0.19).

RL frameworks call ``DistributedDataParallel.broadcast_params()`` right after wrapping. What Megatron's method
(``megatron/core/distributed/distributed_data_parallel.py``) broadcasts over drifted:

* 0.4/0.5: every parameter over parallel_state's data-parallel x context-parallel group (the fact
  ``ddp_broadcast_params_single_group``). The ``data_parallel_group`` the DDP was built with is not used, and
  expert parameters (``allreduce=False``) go over the whole data-parallel group, not over the data-modulo-expert
  group their gradients are reduced over (``finalize_model_grads``): with expert parallelism every rank's experts
  would be overwritten by rank 0's.
* 0.6/0.7: it reads ``self.data_parallel_group`` / ``self.expert_data_parallel_group``, which the constructor never
  sets: ``AttributeError`` (the fact ``ddp_broadcast_params_broken``).
* 0.8-0.12: parallel_state's groups, the ones the constructor reads too.
* 0.13+: the groups the DDP was built with (``dp_cp_group``, ``expt_dp_group``).

:func:`broadcast_params` calls Megatron's method wherever it broadcasts over the DDP's own groups, and does the same
broadcast itself where it does not (0.6/0.7 always, 0.4/0.5 with an explicit group or expert parallelism): every
parameter of ``module.parameters()`` from the first rank of its group, dense ones over the DDP's data-parallel
group, expert ones over its expert-data-parallel group (0.4/0.5: parallel_state's data-modulo-expert group).
"""

from __future__ import annotations

from typing import Any

from ..capabilities import has
from ..errors import InvalidArgumentError, InvalidTypeError
from ._common import (
    as_chunk_list,
    default_dp_group,
    default_expert_dp_group,
    installed_version,
    mcore,
    same_group,
)

__all__ = ["GROUPS_ATTR", "broadcast_params"]

#: Attribute set by :func:`~mcore_compat.training.wrap_ddp` on chunks whose constructor took explicit groups
#: (0.4-0.7): ``(data_parallel_group, expert_data_parallel_group or None)``, as passed.
GROUPS_ATTR = "mcore_compat_dp_groups"


def _is_expert(param: Any) -> bool:
    """Megatron's mark of an expert-parallel parameter (not all-reduced over the whole data-parallel group)."""
    return not getattr(param, "allreduce", True)


def _check_wrapped(chunks: list[Any]) -> None:
    ddp_class = mcore("distributed.distributed_data_parallel").DistributedDataParallel
    for index, chunk in enumerate(chunks):
        if not isinstance(chunk, ddp_class):
            raise InvalidTypeError(
                f"broadcast_params: model chunk {index} ({type(chunk).__name__}) is not wrapped in Megatron-Core's "
                f"DistributedDataParallel. Wrap the chunks first (mcore_compat.training.wrap_ddp(chunks, "
                f"ddp_config=...)) and pass the wrapped chunks."
            )


class _OwnGroups:
    """The groups a DDP-wrapped chunk reduces gradients over (found when first needed).

    In this order: what :func:`~mcore_compat.training.wrap_ddp` recorded (:data:`GROUPS_ATTR`), the
    ``data_parallel_group`` of the chunk's DDP buffers (a DDP built directly), parallel_state's defaults (the
    data-parallel x context-parallel group; the data-modulo-expert / expert-data-parallel group for experts).
    """

    def __init__(self, chunk: Any) -> None:
        self._chunk = chunk
        recorded = getattr(chunk, GROUPS_ATTR, None) or (None, None)
        self._dense: Any = recorded[0]
        self._expert: Any = recorded[1]
        self._buffers_read = False

    def _read_buffers(self) -> None:
        if self._buffers_read:
            return
        self._buffers_read = True
        from ..layout.read import ddp_buffers

        for buffer, is_expert in ddp_buffers(self._chunk, installed_version()):
            group = getattr(buffer, "data_parallel_group", None)
            if is_expert and self._expert is None:
                self._expert = group
            elif not is_expert and self._dense is None:
                self._dense = group

    def dense(self) -> Any:
        if self._dense is None:
            self._read_buffers()
        if self._dense is None:
            self._dense = default_dp_group()
        return self._dense

    def expert(self) -> Any:
        if self._expert is None:
            self._read_buffers()
        if self._expert is None:
            self._expert = default_expert_dp_group()
        if self._expert is None:
            raise InvalidArgumentError(
                "broadcast_params: the model has expert parameters (allreduce=False) but no expert-data-parallel "
                "group is known: initialise parallel_state (expert_model_parallel_size=...) or wrap the chunks "
                "with wrap_ddp(..., expert_data_parallel_group=...)"
            )
        return self._expert

    def of(self, param: Any) -> Any:
        return self.expert() if _is_expert(param) else self.dense()


def _megatron_method_fits(chunk: Any, groups: _OwnGroups) -> bool:
    """Whether Megatron's ``broadcast_params`` of the installed release broadcasts over ``chunk``'s own groups."""
    version = installed_version()
    if has("ddp_broadcast_params_broken", version):
        return False
    if has("ddp_broadcast_params_single_group", version):
        megatron_group = default_dp_group()
        return all(same_group(groups.of(p), megatron_group) for p in chunk.module.parameters())
    return True


def _own_plan(chunk: Any, groups: _OwnGroups) -> list[tuple[Any, Any]]:
    """``(param, group)`` for every parameter of ``chunk``, in ``module.parameters()`` order (as Megatron's)."""
    return [(param, groups.of(param)) for param in chunk.module.parameters()]


def _broadcast_own(plan: list[tuple[Any, Any]]) -> None:
    """What Megatron's ``broadcast_params`` does from 0.8 on: each parameter from its group's first rank."""
    import torch.distributed as dist

    for param, group in plan:
        dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)


def broadcast_params(model_chunks: Any) -> None:
    """Copy every parameter of the first data-parallel rank to the other data-parallel ranks, in place.

    Megatron's ``DistributedDataParallel.broadcast_params`` where it broadcasts over the DDP's own groups, the same
    broadcast done here where it does not (0.6/0.7: ``AttributeError``; 0.4/0.5: parallel_state's group for every
    parameter, whatever group the DDP was built with). Dense parameters go over the DDP's data-parallel group (the
    explicit ``data_parallel_group`` given to :func:`~mcore_compat.training.wrap_ddp` included), expert parameters
    (``allreduce=False``) over its expert-data-parallel group; each from the group's first rank. Parameters are
    written through ``param.data`` in place, so views into DDP's buffers (``param_data`` with the distributed
    optimizer) stay views. Every rank of those groups must call it, with the same chunks.

    Args:
        model_chunks: a model chunk wrapped in Megatron-Core's ``DistributedDataParallel`` (e.g. by
            :func:`~mcore_compat.training.wrap_ddp`), or a list of them (virtual pipeline stages).

    Returns:
        None; the parameters of every chunk now hold the values of the first rank of their data-parallel group.

    Raises:
        InvalidTypeError: a chunk is not wrapped in Megatron-Core's ``DistributedDataParallel`` (checked for every
            chunk before anything is sent).
        InvalidArgumentError: a chunk has expert parameters but no expert-data-parallel group is known.
    """
    chunks, _ = as_chunk_list(model_chunks)
    _check_wrapped(chunks)
    plans: list[list[tuple[Any, Any]] | None] = []  # None: Megatron's method; groups resolved before any send
    for chunk in chunks:
        groups = _OwnGroups(chunk)
        plans.append(None if _megatron_method_fits(chunk, groups) else _own_plan(chunk, groups))
    for chunk, plan in zip(chunks, plans, strict=True):
        if plan is None:
            chunk.broadcast_params()
        else:
            _broadcast_own(plan)
