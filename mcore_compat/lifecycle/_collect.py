"""Which tensors hold the memory of DDP-wrapped model chunks and their optimizer, by piece.

* **params**: the DDP buffers' ``param_data`` (distributed optimizer, Megatron-Core 0.6+; ``None`` without it),
  every parameter of the chunks, frozen ones included (those not in a buffer have storages of their own), and
  the modules' buffers that are not parameters (``register_buffer``: rotary tables, MoE router statistics);
* **grads**: the buffers' flat gradient tensor (``GradBuffer.data`` on 0.4/0.5,
  ``distributed/grad_buffer.py``; ``grad_data`` from 0.6, ``distributed/param_and_grad_buffer.py``; the attribute
  is the fact ``grad_data_attr``), every ``param.main_grad`` (0.4/0.5 expert grads and 0.17+'s fp32 extra main
  grads live outside the buffers), ``param.grad`` and the main params' ``.grad``;
* **optimizer_state**: the optimizer's main params (fp32 copies or shards, read with
  :func:`mcore_compat._util.optimizer_view.optimizer_view`) and every tensor of its torch optimizers' state
  (Adam's ``exp_avg``/``exp_avg_sq``/``step``, ...).

Memory is handled per storage: views (params aliasing ``param_data``, ``main_grad`` aliasing ``grad_data``,
buckets, fp32 shards that are views of the model) follow their storage. A storage reachable from several pieces
belongs to the first of params, grads, optimizer_state (an fp32 param that is its own main param is a param).
Only tensors on the model's device are collected (on CUDA, the CPU ``step`` counters stay where they are).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._util.optimizer_view import optimizer_view
from ..capabilities import fact
from ..layout.read import ddp_buffers
from .errors import OffloadError

__all__ = ["PIECES", "StorageGroup", "collect"]

#: The pieces, in the order a storage reachable from several is assigned.
PIECES: tuple[str, ...] = ("params", "grads", "optimizer_state")


@dataclass(eq=False)
class StorageGroup:
    """One storage and the tensors found on it.

    Attributes:
        key: the storage's ``_cdata``.
        piece: the piece it belongs to (one of :data:`PIECES`).
        tensors: the tensors found on it (the first is the one it is known by).
        pieces: every piece it was reached from.
    """

    key: int
    piece: str
    tensors: list[torch.Tensor] = field(default_factory=list)
    pieces: set[str] = field(default_factory=set)


def _chunk_list(chunks: Any) -> list[Any]:
    return list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]


def _buffers(chunk: Any) -> list[Any]:
    dense_attr, _ = fact("ddp_buffer_attrs")
    if not isinstance(getattr(chunk, dense_attr, None), (list, dict)):  # not Megatron's DDP: parameters only
        return []
    return [b for b, _ in ddp_buffers(chunk, _installed())]


def _installed() -> Any:
    from ..detect import detect

    return detect().version


def _check_chunk(chunk: Any) -> None:
    ddp_config = getattr(chunk, "ddp_config", None)
    if getattr(ddp_config, "nccl_ub", False):
        raise OffloadError(
            "the DDP buffers were allocated for NCCL user buffers (ddp_config.nccl_ub=True): NCCL keeps their "
            "addresses registered, and refilled storage would be unregistered memory. Build DDP with "
            "nccl_ub=False to offload, or keep params and grads resident (offload(..., params=False, grads=False))"
        )


def _check_param(name: str, param: torch.Tensor) -> None:
    if type(param.data) is not torch.Tensor:
        raise OffloadError(
            f"parameter {name!r} is a {type(param.data).__name__}, not a plain tensor (FP8 or otherwise quantized "
            "parameter storage): its bytes are not one resizable storage. Keep the params resident "
            "(offload(..., params=False)) or train without FP8 parameters (fp8_param_gather / "
            "--fp8-param-gather off)"
        )


def _optimizer_tensors(optimizer: Any, want_state: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(main params and state tensors, main params' grads) of ``optimizer``."""
    if optimizer is None:
        return [], []
    leaves, stack = [], [optimizer]
    while stack:
        opt = stack.pop(0)
        chained = getattr(opt, "chained_optimizers", None)
        if chained is not None:
            stack[:0] = list(chained)
        elif not getattr(opt, "is_stub_optimizer", False):  # 0.11+: a rank without params
            leaves.append(opt)
    state: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    for leaf in leaves:
        view = optimizer_view(leaf)
        if view.unsupported is not None:
            if not want_state:
                continue
            raise OffloadError(
                f"cannot offload the state of {type(leaf).__name__}: {view.unsupported}. Offload without it "
                "(offload(..., optimizer_state=False)); for a precision-aware optimizer, "
                "use_precision_aware_optimizer=False; a CPU-offloading (hybrid) optimizer keeps its state on the "
                "host already"
            )
        for mp in view:
            state.append(mp.main)
            if mp.main.grad is not None:
                grads.append(mp.main.grad)
        for inner in view.inner:
            for per_param in inner.state.values():
                state.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    return state, grads


def collect(chunks: Any, optimizer: Any, wanted: Iterable[str]) -> list[StorageGroup]:
    """The storages of the model chunks and the optimizer, each with its piece.

    Args:
        chunks: a DDP-wrapped model chunk or a list of them (a plain module is taken as parameters only).
        optimizer: the Megatron optimizer (``ChainedOptimizer`` included), mcore_compat's legacy optimizer
            (0.4/0.5), or ``None``.
        wanted: the pieces to be moved; the checks of the others are skipped.

    Returns:
        One :class:`StorageGroup` per storage, in a deterministic order.

    Raises:
        OffloadError: a state that cannot be moved in place (FP8 params, NCCL user buffers, a precision-aware
            optimizer, params and grads sharing one storage while only one of them is moved).
    """
    wanted = set(wanted)
    found: dict[str, list[torch.Tensor]] = {piece: [] for piece in PIECES}
    chunk_list: Sequence[Any] = _chunk_list(chunks)
    grad_attr = fact("grad_data_attr")
    for chunk in chunk_list:
        if wanted & {"params", "grads"}:
            _check_chunk(chunk)
        for buffer in _buffers(chunk):
            param_data = getattr(buffer, "param_data", None)
            if param_data is not None:
                found["params"].append(param_data)
            grad_data = getattr(buffer, grad_attr, None)
            if grad_data is not None:
                found["grads"].append(grad_data)
        for name, param in chunk.named_parameters():
            if "params" in wanted:
                _check_param(name, param)
            found["params"].append(param)
            for attr in ("main_grad", "grad"):
                value = getattr(param, attr, None)
                if isinstance(value, torch.Tensor):
                    found["grads"].append(value)
        found["params"].extend(buf for _, buf in chunk.named_buffers())
    state, main_grads = _optimizer_tensors(optimizer, "optimizer_state" in wanted)
    found["grads"].extend(main_grads)
    found["optimizer_state"].extend(state)
    device = next((t.device for piece in PIECES for t in found[piece]), torch.device("cpu"))
    groups: dict[int, StorageGroup] = {}
    for piece in PIECES:
        for tensor in found[piece]:
            if tensor.device.type != device.type:
                continue
            key = tensor.untyped_storage()._cdata
            group = groups.get(key)
            if group is None:
                group = groups[key] = StorageGroup(key, piece)
            group.pieces.add(piece)
            if all(t is not tensor for t in group.tensors):
                group.tensors.append(tensor)
    for group in groups.values():
        moved = group.pieces & wanted
        if moved and moved != group.pieces and {"params", "grads"} <= group.pieces:
            raise OffloadError(
                "params and grads share one storage (a distributed optimizer with MXFP8 params reuses the grad "
                "buffer for the param all-gather): move both or neither (offload(..., params=True, grads=True))"
            )
    return list(groups.values())
