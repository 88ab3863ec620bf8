"""Gather the bound weights of every pipeline stage: one collective per flat buffer per stage.

:func:`gather_pipeline_flat` gives each stage's flat buffers with its :class:`~.manifest.Manifest`
(:class:`StageBuffers`); :func:`gather_pipeline` gives per-parameter views of the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .errors import BindingError
from .manifest import Manifest
from .param_binding import ParamBinding

__all__ = ["StageBuffers", "gather_pipeline", "gather_pipeline_flat"]


def _default_pipeline_group() -> Any:
    import importlib

    return importlib.import_module("megatron.core.parallel_state").get_pipeline_model_parallel_group()


@dataclass(frozen=True)
class StageBuffers:
    """One pipeline stage's flat buffers, as :func:`gather_pipeline_flat` returns them.

    Attributes:
        stage: the stage (group rank in the pipeline group).
        manifest: that stage's :class:`Manifest` (``buffers[i]`` is laid out as ``manifest.buffers[i]``).
        buffers: that stage's flat buffers, by manifest index: on its own stage the live flat buffers of the
            binding (:meth:`ParamBinding.flat_buffers`), on the others the buffers received from it.
    """

    stage: int
    manifest: Manifest
    buffers: list[torch.Tensor]

    def views(self) -> dict[str, torch.Tensor]:
        """``{name: view}`` of :attr:`buffers` (:meth:`Manifest.views`)."""
        return self.manifest.views(self.buffers)


def gather_pipeline_flat(binding: ParamBinding, *, dst: int | None = None, group: Any = None,
                         reuse_buffers: bool = False) -> list[StageBuffers]:
    """All pipeline stages' flat buffers and manifests, with one collective per flat buffer per stage.

    What :func:`gather_pipeline` moves, without building a view per parameter: the form to hand weights to an
    inference engine that loads flat buffers with a manifest (a model of ~2,000 small tensors spends more time
    on the views than on the bytes).

    Every member of ``group`` calls it. Stage ``s`` (the member with group rank ``s``) broadcasts each of its
    flat buffers over ``group`` (with ``dst``: sends it to ``dst`` only); the manifests are exchanged once with
    ``all_gather_object`` and cached on the binding. With tensor parallelism each TP rank gathers its own shards
    over its own pipeline group (parallel_state's default).

    Args:
        binding: this rank's binding (:func:`bind_params`).
        dst: group rank (pipeline stage) that receives; ``None``: every member receives.
        group: the pipeline-parallel group (default: parallel_state's).
        reuse_buffers: receive into buffers cached on the binding (allocated by the first call, one set per
            group and stage) instead of fresh ones. The tensors returned are then the same objects on every
            call, and **each call overwrites what the previous one returned**: copy what must outlive the next
            call. The cache is dropped by :meth:`ParamBinding.unbind`.

    Returns:
        One :class:`StageBuffers` per stage, in stage order: this stage's entry holds its live flat buffers, the
        others the received ones. An empty list on members other than ``dst``.

    Raises:
        BindingError: the binding was unbound, or ``dst`` is not a member of ``group``.
    """
    import torch.distributed as dist

    own_flats = binding.flat_buffers()  # raises BindingError once unbound
    group = group if group is not None else _default_pipeline_group()
    ranks = tuple(dist.get_process_group_ranks(group))
    me = dist.get_rank(group)
    if dst is not None and not 0 <= dst < len(ranks):
        raise BindingError(f"dst={dst} is not a rank of the pipeline group (size {len(ranks)})")
    manifests = binding._manifests_over(group)
    device = collective_device(group, own_flats)
    receive = dst is None or dst == me
    out: list[StageBuffers] = []
    for stage, (src, manifest) in enumerate(zip(ranks, manifests, strict=True)):
        if stage == me:
            flats = binding.flat_buffers()
        elif receive:
            flats = binding._stage_receive_buffers(ranks, stage, manifest, device, reuse_buffers)
        else:
            continue
        for flat in flats:
            if dst is None:
                dist.broadcast(flat, src=src, group=group)
            elif stage != me:
                dist.recv(flat, src=src, group=group)
            elif dst != me:
                dist.send(flat, dst=ranks[dst], group=group)
        if receive:
            out.append(StageBuffers(stage, manifest, flats))
    return out


def gather_pipeline(binding: ParamBinding, *, dst: int | None = None, group: Any = None) -> dict[str, torch.Tensor]:
    """All weights of all pipeline stages, with one collective per flat buffer per stage.

    Every member of ``group`` calls it. Stage ``s`` (the member with group rank ``s``) broadcasts each of its
    flat buffers over ``group`` (with ``dst``: sends it to ``dst`` only); the layouts are exchanged once with
    ``all_gather_object`` and cached on the binding. With tensor parallelism each TP rank gathers its own shards
    over its own pipeline group (parallel_state's default). :func:`gather_pipeline_flat` moves the same bytes
    and returns the flat buffers with their manifests instead of per-parameter views (cheaper for many small
    tensors, and it can receive into reused buffers).

    Args:
        binding: this rank's binding (:func:`bind_params`).
        dst: group rank (pipeline stage) that receives; ``None``: every member receives.
        group: the pipeline-parallel group (default: parallel_state's).

    Returns:
        ``{"stage<s>.<name>": tensor}`` for every stage ``s`` in order and every bound parameter of that stage
        (``<name>`` as in :meth:`ParamBinding.named_views`), i.e. the concatenation of each stage's
        ``named_parameters()`` made unique by the stage prefix. This stage's entries are views of its live flat
        buffers, the others views of freshly received buffers. Empty on members other than ``dst``.

    Raises:
        BindingError: the binding was unbound, or ``dst`` is not a member of ``group``.
    """
    out: dict[str, torch.Tensor] = {}
    for stage in gather_pipeline_flat(binding, dst=dst, group=group):
        prefix = f"stage{stage.stage}."
        out.update({prefix + name: t for name, t in stage.views().items()})
    return out


def collective_device(group: Any, own: list[Any]) -> Any:
    """Where the receive buffers of a collective over ``group`` live: this rank's flat buffers' device, else the
    current CUDA device under NCCL, else the CPU."""
    import torch.distributed as dist

    if own:
        return own[0].device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
