"""A Megatron-style optimizer for megatron-core 0.4.0 / 0.5.0, whose wheels ship no ``megatron.core.optimizer``.

:func:`build_legacy_optimizer` reproduces the behaviour of Megatron's own optimizer (``get_megatron_optimizer``
of 0.6+) on top of the 0.4/0.5 ``DistributedDataParallel`` grad buffers; it is our own code, not a copy.

* **Param groups** as Megatron's ``_get_param_groups``: keyed by ``(wd_mult, lr_mult, is_expert_parallel,
  is_decoupled_lr)``; by default biases and 1-D params get ``wd_mult=0``; with ``config.decoupled_lr`` the
  embedding and output-layer weights get ``max_lr = decoupled_lr`` (``min_lr = decoupled_min_lr``, default
  ``min_lr``). The effective values are set at build time: ``lr = max_lr * lr_mult``, ``weight_decay = wd *
  wd_mult`` (``get_megatron_optimizer`` does the same on 0.6+; a scheduler keeps them per step).
* **Main params** are fp32: an fp32 model param is its own main param (updated in place); a bf16/fp16 param gets
  an fp32 master copy, written back (cast) after each step. Grads come from ``param.main_grad`` (the DDP grad
  buffer) when the param has one, else ``param.grad``. Grads must already be data-parallel reduced
  (``ddp.finish_grad_sync()`` / ``finalize_model_grads``), exactly as with Megatron's optimizer.
* ``config.optimizer == 'adam'`` is torch ``AdamW`` (Megatron's Adam is decoupled-weight-decay); ``'sgd'`` is
  ``SGD(momentum=config.sgd_momentum)``.
* **step()** -> ``(update_successful, grad_norm, num_zeros_in_grad)``: fp16 loss-scale unscaling with an
  inf/nan check (found-inf max-reduced over the model-parallel group, plus the data-parallel group when
  distributed); on overflow the step is skipped and ``(False, None, None)`` returned. The L2 grad norm counts
  each element once: params that are ``shared`` are skipped, tensor-parallel duplicates (no
  ``tensor_model_parallel=True`` attribute) count on TP rank 0 only, expert params (``allreduce=False``) on
  expert-data-parallel rank 0 (each expert-parallel rank holds its own experts); it is sum-reduced over the
  model-parallel group (and the data-parallel group when distributed; the experts' part always). Unlike Megatron 0.6-0.11 the norm is returned even when
  ``clip_grad == 0``. Clipping: ``coeff = clip_grad / (norm + 1e-6)`` applied when ``< 1``.
* **Distributed mode** (``use_distributed_optimizer``): the flat parameter space is sharded over the
  data-parallel group. For a model chunk that is a 0.4/0.5 DDP the sharding is the one DDP's reduce-scatter
  produces: every bucket ``[s, e)`` of every ``ddp.grad_buffers[dtype]`` (padded by DDP to a multiple of the DP
  size) is cut in ``W`` equal pieces and DP rank ``r`` owns piece ``r`` (the only piece whose grads are reduced
  when DDP was built with ``use_distributed_optimizer=True``). For a chunk without grad buffers we lay its
  trainable params out the same way (reverse ``named_parameters`` order, one bucket padded to a multiple of
  ``W``). Each rank keeps fp32 main params and optimizer state for its piece only; after the step every bucket is
  all-gathered (in the buffer's dtype) and copied into every rank's model params. Params outside any grad
  buffer (expert params, ``allreduce=False``) are optimized whole and identically on every rank.
  ``state_dict()`` is per rank (each rank's shard), not gathered.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from .errors import InvalidArgumentError

__all__ = ["LegacyOptimizer", "build_legacy_optimizer"]

Group = Optional[dist.ProcessGroup]


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _cfg(config: Any, name: str, default: Any) -> Any:
    """Read ``name`` from a dict, dataclass or namespace config; ``default`` when absent or ``None``."""
    value = config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)
    return default if value is None else value


def _parallel_state() -> Any:
    """megatron's ``parallel_state`` when it is already imported and initialized, else ``None``."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state


def _size(group: Group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _rank(group: Group) -> int:
    return dist.get_rank(group) if group is not None else 0


def _all_reduce(value: torch.Tensor, op: Any, groups: Iterable[Group]) -> torch.Tensor:
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(value, op=op, group=group)
    return value


def _is_expert(param: torch.nn.Parameter) -> bool:
    """An expert param (Megatron marks them ``allreduce=False``: reduced over expert data parallelism)."""
    return not getattr(param, "allreduce", True)


@dataclass
class _Slot:
    """One fp32 main tensor: ``model_param.view(-1)[start:end]`` (or the whole param when ``start is None``)."""

    model_param: torch.nn.Parameter
    main: torch.Tensor
    start: Optional[int] = None
    end: Optional[int] = None
    replicated: bool = False  # distributed mode: optimized whole on every DP rank (counted on DP rank 0)

    def model_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part of ``tensor`` (model param or its grad) this slot covers."""
        return tensor if self.start is None else tensor.view(-1)[self.start : self.end]


@dataclass
class _Bucket:
    """A shardable flat region ``[0, numel)``; ``params`` lists ``(param, offset_in_bucket)``."""

    params: list[tuple[torch.nn.Parameter, int]]
    numel: int
    dtype: torch.dtype
    group: Group


class _GradScaler:
    """Megatron's constant / dynamic loss scaler (growth x2, backoff x0.5, hysteresis)."""

    def __init__(self, initial: float, dynamic: bool, min_scale: float = 1.0, window: int = 1000,
                 hysteresis: int = 2) -> None:
        self.scale, self.dynamic, self.min_scale = float(initial), dynamic, float(min_scale)
        self.window, self.hysteresis = int(window), int(hysteresis)
        self.growth_tracker, self.hysteresis_tracker = 0, self.hysteresis

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * 0.5, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.window:
                self.growth_tracker, self.hysteresis_tracker = 0, self.hysteresis
                self.scale *= 2.0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker, self.hysteresis_tracker = state["growth_tracker"], state["hysteresis_tracker"]


#: Names of the embedding / output-layer weights of 0.4/0.5's GPTModel, which (unlike 0.6+'s LanguageModule,
#: megatron/core/models/common/language_module/language_module.py) does not mark them
#: ``is_embedding_or_output_parameter``: the params a decoupled learning rate applies to.
_EMBEDDING_OR_OUTPUT_NAMES = ("embedding.word_embeddings.weight", "output_layer.weight")


def _is_embedding_or_output(name: str, param: torch.nn.Parameter) -> bool:
    return bool(getattr(param, "is_embedding_or_output_parameter", False)) or name.endswith(_EMBEDDING_OR_OUTPUT_NAMES)


def _param_groups(model_chunks: Sequence[torch.nn.Module], no_weight_decay_cond: Optional[Callable[..., bool]],
                  scale_lr_cond: Optional[Callable[..., bool]], lr_mult: float, decoupled: bool = False,
                  is_decoupled: Callable[[str, Any], bool] = _is_embedding_or_output) -> list[dict[str, Any]]:
    """Megatron's ``_get_param_groups`` (0.6-0.15's signature and group keys, without 0.6/0.7's ``lr_mult``
    shadowing): trainable params keyed by ``(wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr)``;
    ``decoupled``: the params ``is_decoupled(name, param)`` names get the decoupled learning rate (by default
    embedding/output params, marked or, as 0.4/0.5's GPTModel leaves them unmarked, by name)."""
    groups: dict[tuple[float, float, bool, bool], list[torch.nn.Parameter]] = {}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            no_wd = (no_weight_decay_cond(name, param) if no_weight_decay_cond is not None
                     else name.endswith(".bias") or param.dim() == 1)
            scale_lr = scale_lr_cond(name, param) if scale_lr_cond is not None else False
            key = (0.0 if no_wd else 1.0, lr_mult if scale_lr else 1.0, not getattr(param, "allreduce", True),
                   decoupled and is_decoupled(name, param))
            groups.setdefault(key, []).append(param)
    return [{"params": ps, "wd_mult": wd, "lr_mult": lm, "is_expert_parallel": ep, "is_decoupled_lr": dec}
            for (wd, lm, ep, dec), ps in groups.items()]


def _buckets(chunk: torch.nn.Module, dp_group: Group) -> list[_Bucket]:
    """The shardable regions of one model chunk: DDP (0.4/0.5) buckets, or one virtual padded bucket."""
    grad_buffers = getattr(chunk, "grad_buffers", None)
    if isinstance(grad_buffers, dict) and grad_buffers:
        out = []
        for buffer in grad_buffers.values():
            for bucket in buffer.buckets:
                # by offset: 0.4's Bucket.params_list comes from a set (distributed/grad_buffer.py), so its order,
                # and with it the order grad norms are summed in, would differ between two identical builds
                params = sorted(((p, buffer.param_index_map[p][0] - bucket.offset) for p in bucket.params_list),
                                key=lambda item: item[1])
                out.append(_Bucket(params, bucket.data.numel(), buffer.dtype, bucket.data_parallel_group))
        return out
    params, offset = [], 0
    for _, param in reversed(list(chunk.named_parameters())):
        if param.requires_grad:
            params.append((param, offset))
            offset += param.numel()
    world = _size(dp_group)
    return [_Bucket(params, math.ceil(offset / world) * world, torch.float32, dp_group)] if params else []


class LegacyOptimizer:
    """Megatron-style mixed-precision / distributed optimizer; build it with :func:`build_legacy_optimizer`."""

    def __init__(self, config: Any, model_chunks: Sequence[torch.nn.Module], param_groups: list[dict[str, Any]],
                 data_parallel_group: Group, model_parallel_group: Group, tensor_parallel_rank: int,
                 expert_data_parallel_rank: int = 0) -> None:
        self.config, self.model_chunks = config, list(model_chunks)
        self.distributed = bool(_cfg(config, "use_distributed_optimizer", False))
        self.clip_grad = float(_cfg(config, "clip_grad", 1.0))
        self.log_num_zeros = bool(_cfg(config, "log_num_zeros_in_grad", False))
        self._dp_group, self._mp_group, self._tp_rank = data_parallel_group, model_parallel_group, tensor_parallel_rank
        self._edp_rank = expert_data_parallel_rank
        fp16, bf16, loss_scale = _cfg(config, "fp16", False), _cfg(config, "bf16", False), _cfg(config, "loss_scale", 0)
        self.grad_scaler: Optional[_GradScaler] = None
        if loss_scale and (fp16 or bf16 or self.distributed):
            self.grad_scaler = _GradScaler(loss_scale, dynamic=False)
        elif fp16:
            self.grad_scaler = _GradScaler(_cfg(config, "initial_loss_scale", 2.0**32), True,
                                           _cfg(config, "min_loss_scale", 1.0), _cfg(config, "loss_scale_window", 1000),
                                           _cfg(config, "hysteresis", 2))
        if not self.distributed and any(getattr(c, "use_distributed_optimizer", False) for c in self.model_chunks):
            raise InvalidArgumentError(
                "DDP was built with use_distributed_optimizer=True (grads are only reduce-scattered); "
                "set use_distributed_optimizer=True in the optimizer config too"
            )
        self._slots: list[_Slot] = []
        self._buckets: list[tuple[_Bucket, list[_Slot]]] = []  # distributed mode: buckets to all-gather
        slots_of = self._build_slots()
        inner_groups = [{**{k: v for k, v in g.items() if k != "params"},
                         "params": [s.main for p in g["params"] for s in slots_of.get(p, [])]} for g in param_groups]
        self.optimizer = self._make_inner(inner_groups)

    # ----------------------------------------------------------------------------------------------- building
    def _build_slots(self) -> dict[torch.nn.Parameter, list[_Slot]]:
        slots_of: dict[torch.nn.Parameter, list[_Slot]] = {}

        def add(slot: _Slot) -> _Slot:
            self._slots.append(slot)
            slots_of.setdefault(slot.model_param, []).append(slot)
            return slot

        def main_of(param: torch.nn.Parameter, start: Optional[int], end: Optional[int]) -> torch.Tensor:
            if start is None and param.dtype == torch.float32:
                return param  # an fp32 param is its own main param (Megatron's FP32Optimizer)
            view = param.detach() if start is None else param.detach().view(-1)[start:end]
            return view if param.dtype == torch.float32 else view.clone().float()

        sharded: set[torch.nn.Parameter] = set()
        if self.distributed:
            for chunk in self.model_chunks:
                for bucket in _buckets(chunk, self._dp_group):
                    world, rank = _size(bucket.group), _rank(bucket.group)
                    if bucket.numel % world:
                        raise InvalidArgumentError(
                            f"bucket of {bucket.numel} elements is not padded to the DP size {world}; "
                            "build DDP with use_distributed_optimizer=True"
                        )
                    lo, hi = rank * bucket.numel // world, (rank + 1) * bucket.numel // world
                    owned = []
                    for param, off in bucket.params:
                        sharded.add(param)
                        a, b = max(lo, off) - off, min(hi, off + param.numel()) - off
                        if a < b:
                            owned.append(add(_Slot(param, main_of(param, a, b), a, b)))
                    self._buckets.append((bucket, owned))
        seen: set[torch.nn.Parameter] = set()
        for chunk in self.model_chunks:
            for param in chunk.parameters():
                if param.requires_grad and param not in sharded and param not in seen:
                    seen.add(param)
                    add(_Slot(param, main_of(param, None, None), replicated=self.distributed))
        return slots_of

    def _make_inner(self, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        cfg, kind = self.config, str(_cfg(self.config, "optimizer", "adam")).lower()
        lr, wd = float(_cfg(cfg, "lr", 1e-3)), float(_cfg(cfg, "weight_decay", 0.01))
        # A bound the config does not set stays None, as in Megatron's groups (0.6+): optimizer_param_scheduler
        # fills it with the scheduler's own value (a 0.0 here would decay those groups to 0).
        min_lr = _float_or_none(_cfg(cfg, "min_lr", None))
        decoupled_lr = _cfg(cfg, "decoupled_lr", None)
        decoupled_min_lr = _float_or_none(_cfg(cfg, "decoupled_min_lr", min_lr))
        for g in groups:
            max_lr, low = ((float(decoupled_lr), decoupled_min_lr) if g.get("is_decoupled_lr") else (lr, min_lr))
            g.update(lr=max_lr * g["lr_mult"], weight_decay=wd * g["wd_mult"], max_lr=max_lr, min_lr=low)
        if kind == "adam":
            return torch.optim.AdamW(groups, lr=lr, weight_decay=wd, eps=float(_cfg(cfg, "adam_eps", 1e-8)),
                                     betas=(float(_cfg(cfg, "adam_beta1", 0.9)), float(_cfg(cfg, "adam_beta2", 0.999))))
        if kind == "sgd":
            return torch.optim.SGD(groups, lr=lr, weight_decay=wd, momentum=float(_cfg(cfg, "sgd_momentum", 0.9)))
        raise InvalidArgumentError(f"{kind!r} optimizer is not supported (use 'adam' or 'sgd')")

    # ----------------------------------------------------------------------------------------------- public API
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner torch optimizer's param groups (their params are the fp32 main tensors / shards)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    def get_loss_scale(self) -> torch.Tensor:
        """Current loss scale (1.0 without a grad scaler)."""
        return torch.tensor(self.grad_scaler.scale if self.grad_scaler else 1.0, dtype=torch.float32)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` (call ``backward`` on the result)."""
        return loss * self.get_loss_scale().to(loss.device)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``.grad`` of model params and main params (DDP's grad buffer is DDP's ``zero_grad_buffer``)."""
        params = [p for chunk in self.model_chunks for p in chunk.parameters() if p.requires_grad]
        for t in params + [slot.main for slot in self._slots]:  # every model param: a rank may own none of it
            if set_to_none:
                t.grad = None
            elif t.grad is not None:
                t.grad.detach_().zero_()

    def reload_model_params(self) -> None:
        """Copy the model params into the fp32 main params (after loading a model checkpoint)."""
        with torch.no_grad():
            for slot in self._slots:
                slot.main.copy_(slot.model_view(slot.model_param.detach()))

    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state, grad scaler and fp32 main params (this rank's shard in distributed mode)."""
        return {"optimizer": self.optimizer.state_dict(),
                "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,
                "main_params": [s.main.detach().clone() for s in self._slots]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict` (model params themselves come from the model's checkpoint)."""
        self.optimizer.load_state_dict(state["optimizer"])
        if self.grad_scaler is not None and state.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        with torch.no_grad():
            for slot, saved in zip(self._slots, state["main_params"], strict=True):
                slot.main.copy_(saved)

    @torch.no_grad()
    def step(self, *_unused: Any, **_unused_kw: Any) -> tuple[bool, Optional[float], Optional[float]]:
        """One update. Extra arguments (0.4/0.5 Megatron-LM's ``step(args, timers)``) are ignored.

        Returns:
            ``(update_successful, grad_norm, num_zeros_in_grad)``; ``(False, None, None)`` when fp16
            overflow made the step skip. ``num_zeros_in_grad`` is ``None`` unless ``log_num_zeros_in_grad``.
        """
        groups = [self._mp_group, self._dp_group] if self.distributed else [self._mp_group]
        for slot in self._slots:  # model grads -> main grads
            source = getattr(slot.model_param, "main_grad", None)
            source = slot.model_param.grad if source is None else source
            slot.main.grad = None if source is None else slot.model_view(source).float()
        grads = [s.main.grad for s in self._slots if s.main.grad is not None]
        if self.grad_scaler is not None:
            inv_scale, found = 1.0 / self.grad_scaler.scale, torch.zeros(1, device=self._device())
            for g in grads:
                g.mul_(inv_scale)
                found = torch.maximum(found, (~torch.isfinite(g)).any().float().view(1))
            found_inf = bool(_all_reduce(found, dist.ReduceOp.MAX, groups).item() > 0)
            self.grad_scaler.update(found_inf)
            if found_inf:
                return False, None, None
        counted = [s.main.grad for s in self._slots if s.main.grad is not None and self._counts(s)]
        sumsq = torch.zeros(1, dtype=torch.float32, device=self._device())
        expert_sumsq = torch.zeros(1, dtype=torch.float32, device=self._device())
        for s in self._slots:
            if s.main.grad is not None and self._counts(s):
                target = expert_sumsq if _is_expert(s.model_param) else sumsq
                target += torch.linalg.vector_norm(s.main.grad).square()
        # expert params differ over the expert-parallel ranks, which lie inside the data-parallel group: their
        # squares are summed over it whether or not the optimizer is distributed
        sumsq += _all_reduce(expert_sumsq, dist.ReduceOp.SUM, [self._dp_group]) if not self.distributed \
            else expert_sumsq
        grad_norm = float(_all_reduce(sumsq, dist.ReduceOp.SUM, groups).item()) ** 0.5
        if self.clip_grad > 0.0 and self.clip_grad / (grad_norm + 1.0e-6) < 1.0:
            coeff = self.clip_grad / (grad_norm + 1.0e-6)
            for g in grads:
                g.mul_(coeff)
        num_zeros = None
        if self.log_num_zeros:
            zeros = torch.zeros(1, dtype=torch.float32, device=self._device())
            for g in counted:
                zeros += g.numel() - torch.count_nonzero(g)
            num_zeros = float(_all_reduce(zeros, dist.ReduceOp.SUM, groups).item())
        self.optimizer.step()
        self._copy_main_to_model()
        return True, grad_norm, num_zeros

    # ----------------------------------------------------------------------------------------------- helpers
    def _device(self) -> torch.device:
        """Where the reduction scalars live: with the params (NCCL reduces CUDA tensors only)."""
        if self._slots:
            return self._slots[0].main.device
        if dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _counts(self, slot: _Slot) -> bool:
        """Whether ``slot``'s grad enters the norm here (each element once over the whole world): the tied copy
        (``shared``) never, tensor-parallel duplicates on TP rank 0, a param every data-parallel rank holds whole
        on DP rank 0, an expert param (its expert-parallel rank's own) on expert-data-parallel rank 0."""
        param = slot.model_param
        if getattr(param, "shared", False):
            return False
        if not getattr(param, "tensor_model_parallel", False) and self._tp_rank != 0:
            return False
        if _is_expert(param):
            return self._edp_rank == 0
        return not (slot.replicated and _rank(self._dp_group) != 0)

    def _copy_main_to_model(self) -> None:
        for slot in self._slots:
            if slot.start is None and slot.main is not slot.model_param:
                slot.model_param.data.copy_(slot.main)
        for bucket, owned in self._buckets:  # distributed mode: assemble every bucket on every DP rank
            world, rank = _size(bucket.group), _rank(bucket.group)
            flat = torch.zeros(bucket.numel, dtype=bucket.dtype, device=bucket.params[0][0].device)
            piece = bucket.numel // world
            offsets = {p: off for p, off in bucket.params}
            for slot in owned:
                assert slot.start is not None  # an owned slot is a shard of its param
                start = offsets[slot.model_param] + slot.start
                flat[start : start + slot.main.numel()].copy_(slot.main)
            if world > 1:
                mine = flat[rank * piece : (rank + 1) * piece].clone()
                dist.all_gather(list(flat.split(piece)), mine, group=bucket.group)
            for param, off in bucket.params:
                param.data.view(-1).copy_(flat[off : off + param.numel()])


def build_legacy_optimizer(config: Any, model_chunks: Sequence[torch.nn.Module] | torch.nn.Module, *,
                           no_weight_decay_cond: Optional[Callable[..., bool]] = None,
                           scale_lr_cond: Optional[Callable[..., bool]] = None, lr_mult: float = 1.0,
                           data_parallel_group: Group = None,
                           model_parallel_group: Group = None) -> LegacyOptimizer:
    """Build a Megatron-style optimizer for megatron-core 0.4/0.5 models (works on any torch modules).

    Args:
        config: Megatron ``OptimizerConfig``-like fields (dataclass, dict or namespace): ``optimizer``, ``lr``,
            ``min_lr``, ``weight_decay``, ``fp16``, ``bf16``, ``loss_scale``, ``initial_loss_scale``,
            ``min_loss_scale``, ``loss_scale_window``, ``hysteresis``, ``adam_beta1/2``, ``adam_eps``,
            ``sgd_momentum``, ``use_distributed_optimizer``, ``clip_grad``, ``log_num_zeros_in_grad``,
            ``decoupled_lr``, ``decoupled_min_lr``.
        model_chunks: the model chunks (0.4/0.5 ``DistributedDataParallel`` or plain modules).
        no_weight_decay_cond: ``(name, param) -> bool``; default: biases and 1-D params.
        scale_lr_cond: ``(name, param) -> bool`` selecting params whose lr is multiplied by ``lr_mult``.
        data_parallel_group: default: the DDP grad buffers' group, else megatron's DP group (with context
            parallel) when initialized, else WORLD when torch.distributed is initialized, else none.
        model_parallel_group: default: megatron's model-parallel group when initialized, else none.
    """
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    ps = _parallel_state()
    if data_parallel_group is None:
        buffers = [b for c in chunks for b in (getattr(c, "grad_buffers", None) or {}).values()]
        if buffers:
            data_parallel_group = buffers[0].data_parallel_group
        elif ps is not None:
            data_parallel_group = ps.get_data_parallel_group(with_context_parallel=True)
        elif dist.is_available() and dist.is_initialized():
            data_parallel_group = dist.group.WORLD
    if model_parallel_group is None and ps is not None:
        model_parallel_group = ps.get_model_parallel_group()
    tp_rank = ps.get_tensor_model_parallel_rank() if ps is not None else 0
    edp = getattr(ps, "get_data_modulo_expert_parallel_group", None) if ps is not None else None
    edp_rank = 0
    if edp is not None:
        try:
            edp_rank = _rank(edp())
        except (AssertionError, RuntimeError):  # no expert groups
            edp_rank = 0
    groups = _param_groups(chunks, no_weight_decay_cond, scale_lr_cond, lr_mult,
                           decoupled=_cfg(config, "decoupled_lr", None) is not None)
    return LegacyOptimizer(config, chunks, groups, data_parallel_group, model_parallel_group, tp_rank, edp_rank)
