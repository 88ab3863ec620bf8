"""The gradient reference: the same micro-batches through a plain-autograd copy of the model.

No DDP, no schedule, no ``finalize_model_grads``, nothing of mcore_compat's training adapters: a copy of each
model chunk's module (same weights, same Megatron layers, so the same kernels on the same inputs) runs the
micro-batches one after another through every pipeline stage in order, passing activations and their
gradients between stages with plain ``torch.distributed`` send/recv. The per-micro-batch gradients are summed
the way Megatron's DDP keeps them (into a buffer of the gradient dtype: fp32 with ``grad_reduce_in_fp32``,
else the param dtype), then reduced by hand to what the whole batch's gradient is:

* over data parallelism: the mean over the data-parallel group (expert params: the sum over the
  expert-data-parallel group divided by the data-parallel size, the mean over all ranks' tokens);
* params that each tensor-parallel rank computes from its sequence shard (``sequence_parallel``): the sum over
  the tensor-parallel group;
* a weight shared by the first stage (input embedding) and the last stage (output layer): the sum of both.

Each element also gets the bound its value may differ by from any other order of the same sums: summing
``k`` terms in a dtype of unit roundoff ``u`` errs by at most ``(k-1)*u*S`` (``S`` = the sum of the terms'
magnitudes), so two orders differ by at most ``2*(k-1)*u*S``, plus ``2u`` of the value for a non-power-of-two
mean. The per-micro-batch gradients themselves are those of the same kernels on the same inputs. On an
accelerator the magnitudes are held in bfloat16 rounded up during the backward (never below the fp32 sum; the
bound grows by at most ``2^-7`` of itself), widened to fp32 for the reductions once the activations are gone: two
bytes per element less at the reference's peak; on the CPU they are summed in fp32 (the rounding costs more time
there than the memory is worth). The sums run per block of params (:class:`_BlockSums`: a few kernels per block,
not ten per param).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._util.own_math import own_tensor_math
from . import rng_replay
from .rng_replay import RngReplay
from .wrappers import unwrap_ddp

__all__ = ["GradReference", "PlainReference", "unwrap_ddp"]

_DTYPES = ("float32", "bfloat16", "float16", "float64", "int64")


def _plain_copy(module: Any, share_weights: bool = False, dtype: Any = None,
                configs: dict[int, Any] | None = None) -> Any:
    """A deep copy of ``module`` with fresh parameters (no DDP attributes such as ``main_grad``) that shares
    what must not be copied: process groups and the transformer configs (whose hooks hold the optimizer).
    ``share_weights``: the fresh parameters are views of the model's weights (no copy of their values; their
    gradients are their own). ``dtype``: the fresh parameters are cast to it (a copy). ``configs``: ``{id(config):
    the copy's config}`` for configs the copy gets in place of the module's."""
    import torch
    import torch.distributed as dist

    memo: dict[int, Any] = dict(configs or {})
    for p in module.parameters():
        value = p.detach().to(dtype) if dtype is not None else p.detach() if share_weights else p.detach().clone()
        if dtype is not None and value.data_ptr() == p.data_ptr():  # already of that dtype: .to made no copy
            value = value.clone()
        memo[id(p)] = torch.nn.Parameter(value, requires_grad=p.requires_grad)
    for sub in module.modules():
        for attr in ("config", "ddp_config", "pg_collection"):
            value = sub.__dict__.get(attr)
            if value is not None and id(value) not in memo:
                memo[id(value)] = _without_hooks(value) if share_weights and attr == "config" else value
    cls = dist.ProcessGroup
    had = "__deepcopy__" in cls.__dict__
    previous = cls.__dict__.get("__deepcopy__")
    setattr(cls, "__deepcopy__", lambda self, _memo: self)
    tensor_copy = torch.Tensor.__deepcopy__

    def leaf_copy(self: Any, memo_: dict[int, Any]) -> Any:
        # a tensor kept from the last forward (a MoE token dispatcher's routing map and probs) is not a graph
        # leaf, which deepcopy refuses: the copy gets its value, detached
        if self.grad_fn is not None:
            return self.detach().clone()
        return tensor_copy(self, memo_)

    torch.Tensor.__deepcopy__ = leaf_copy  # type: ignore[method-assign]
    try:
        return copy.deepcopy(module, memo)
    finally:
        torch.Tensor.__deepcopy__ = tensor_copy  # type: ignore[method-assign]
        if had:
            setattr(cls, "__deepcopy__", previous)
        else:
            delattr(cls, "__deepcopy__")


#: the schedule's hooks a model config holds (they reach the DDP-wrapped model; the copy runs no schedule)
_CONFIG_HOOKS = ("finalize_model_grads_func", "grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func")


def _without_hooks(config: Any) -> Any:
    """A shallow copy of a model config with the schedule's hooks cleared, so that a copy of the model kept for
    later checks holds no reference to the model itself (else the model could never be freed); the config itself
    where it is not a dataclass with those fields."""
    if not dataclasses.is_dataclass(config) or not any(hasattr(config, h) for h in _CONFIG_HOOKS):
        return config
    out = copy.copy(config)
    for hook in _CONFIG_HOOKS:
        if hasattr(out, hook):
            setattr(out, hook, None)
    return out


#: the weight-sharing copy made for a module (its key), reused by the next one-step check of it while valid
_SHARED: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _shared_copy(module: Any) -> Any:
    """:func:`_plain_copy` with ``share_weights``, reused from the last call for ``module`` where each parameter
    of the copy still views the storage, shape and dtype of the module's (else made anew); the buffers are copied
    from the module again, so the copy runs on its current state. One deep copy of the module's structure per
    module instead of per check (~40 ms per check of the 0.94 B benchmark GPT on an H200). The copy holds no
    reference to the module (:func:`_without_hooks`), so the entry goes with the module."""
    import torch

    kept = _SHARED.get(module)
    if kept is not None:
        theirs = dict(kept.named_parameters())
        mine = list(module.named_parameters())
        buffers = dict(kept.named_buffers())
        valid = len(theirs) == len(mine) and all(
            n in theirs and theirs[n].data_ptr() == p.data_ptr() and theirs[n].shape == p.shape
            and theirs[n].dtype == p.dtype and theirs[n].requires_grad == p.requires_grad for n, p in mine) \
            and all(n in buffers and buffers[n].shape == b.shape and buffers[n].dtype == b.dtype
                    for n, b in module.named_buffers())
        if valid:
            with torch.no_grad():
                for n, b in module.named_buffers():
                    buffers[n].copy_(b)
            for p in kept.parameters():
                p.grad = None
            for theirs_m, mine_m in zip(kept.modules(), module.modules(), strict=False):
                theirs_m.training = mine_m.training
            return kept
    kept = _SHARED[module] = _plain_copy(module, share_weights=True)
    return kept


@dataclass
class GradReference:
    """The reference gradients of one step.

    Attributes:
        grads: ``{model param: gradient}`` (the dtype Megatron keeps it in), for this rank's trainable params.
        bounds: ``{model param: per-element bound}`` (fp32; see the module docstring).
        losses: the loss function's outputs per micro-batch (last pipeline stage only).
        terms: ``{model param: number of summed terms}``.
    """

    grads: dict[Any, Any] = field(default_factory=dict)
    bounds: dict[Any, Any] = field(default_factory=dict)
    losses: list[Any] = field(default_factory=list)
    terms: dict[Any, int] = field(default_factory=dict)


def _is_expert(param: Any) -> bool:
    return not getattr(param, "allreduce", True)


def _group_size(group: Any) -> int:
    import torch.distributed as dist

    return 1 if group is None else dist.get_world_size(group)


class PlainReference:
    """Plain-autograd copies of the model chunks of this rank, kept at the model's current weights.

    Args:
        chunks: the DDP-wrapped model chunks of this rank (virtual pipeline stages in order).
        groups: the process groups (:class:`~mcore_compat.selfcheck.groups.Groups`) of this rank.
        grad_dtype: ``param -> torch.dtype`` of the gradient buffer Megatron keeps (``main_grad``'s dtype).
        share_weights: the copies' parameters are views of the model's weights, not copies of them (for a check
            of one step, whose reference runs before the weights change: one model's param bytes less).
    """

    def __init__(self, chunks: Sequence[Any], groups: Any, grad_dtype: Callable[[Any], Any],
                 per_token_loss: bool = False, share_weights: bool = False) -> None:
        self.per_token_loss = per_token_loss
        self.share_weights = share_weights
        self.originals = [unwrap_ddp(c) for c in chunks]
        self.copies = [_shared_copy(m) if share_weights else _plain_copy(m) for m in self.originals]
        self.groups = groups
        self.grad_dtype = grad_dtype
        self.pairs: list[list[tuple[Any, Any]]] = []
        for orig, dup in zip(self.originals, self.copies, strict=True):
            dup_params = dict(dup.named_parameters())
            self.pairs.append([(p, dup_params[n]) for n, p in orig.named_parameters() if p.requires_grad])

    def nbytes(self) -> int:
        """Bytes held by the copies (parameters unless shared, and buffers)."""
        return sum(t.numel() * t.element_size() for m in self.copies
                   for t in ((*m.parameters(), *m.buffers()) if not self.share_weights else tuple(m.buffers())))

    def release(self) -> None:
        """Drop the copies (a one-step check is done with them once the reference has run)."""
        self.copies = []
        self.pairs = [[] for _ in self.originals]

    def sync(self) -> None:
        """Copy the model's current weights into the copies."""
        import torch

        if self.share_weights:
            return
        with torch.no_grad():
            for pairs in self.pairs:
                for orig, dup in pairs:
                    dup.copy_(orig)

    # -------------------------------------------------------------------------------------------- pipeline
    def run(self, forward_step_func: Callable[..., Any], batches: Sequence[Sequence[Any] | None],
            num_microbatches: int,
            *, loss_scale: float = 1.0, rng: RngReplay | None = None) -> GradReference:
        """The reference gradients of one step (collective over every rank of the run).

        With ``rng``, each forward first restores the random state the real step's forward of the same chunk
        and micro-batch started from (the same dropout masks). Either way the random state is the same after
        this call as before it: checking a step leaves the random streams of the training that follows as an
        unchecked step would.

        Args:
            forward_step_func: the same ``forward_step_func(data_iterator, model)`` the schedule gets.
            batches: per model chunk, the micro-batches its data iterator yields (the same list the step used),
                ``None`` for a chunk whose stage reads no data (its forward step gets ``None``).
            num_microbatches: micro-batches per step.
            loss_scale: the optimizer's loss scale (the schedule multiplies the loss by it before backward).
            rng: the states recorded during the real step (:class:`~.rng_replay.RngReplay`).
        """
        left = rng_replay.capture()
        try:
            return self._run(forward_step_func, batches, num_microbatches, loss_scale, rng)
        finally:
            rng_replay.restore(left)

    def _run(self, forward_step_func: Callable[..., Any], batches: Sequence[Sequence[Any] | None],
             num_microbatches: int, loss_scale: float, rng: RngReplay | None) -> GradReference:
        self.sync()
        g = self.groups
        acc: dict[Any, Any] = {}
        mag: dict[Any, Any] = {}
        out = GradReference()
        per_token: list[Any] = []
        iters = [None if b is None else iter(b) for b in batches]
        stages = g.pp * len(self.copies)
        sums = [_BlockSums(pairs, self.grad_dtype) for pairs in self.pairs]
        try:
            self._microbatches(forward_step_func, iters, num_microbatches, loss_scale, rng, stages, out, per_token,
                               sums)
        finally:
            for s in sums:
                s.close(acc, mag)
        g.set_virtual_rank(None)
        for p in mag:  # the reductions in fp32, once the backward's activations are gone
            mag[p] = mag[p].float()
        terms = {p: num_microbatches for p in acc}
        self._reduce(acc, mag, terms, per_token)
        for p, value in acc.items():  # the bound in place of the magnitudes: no third tensor per param
            u = _unit_roundoff(value.dtype)
            k = terms[p]
            bound = mag.pop(p).mul_(2.0 * (k - 1) * u)
            bound.add_(value.float().abs().mul_(2.0 * u))
            out.bounds[p] = bound
        out.grads, out.terms = acc, terms
        return out

    def _microbatches(self, forward_step_func: Callable[..., Any], iters: list[Any], num_microbatches: int,
                      loss_scale: float, rng: RngReplay | None, stages: int, out: GradReference,
                      per_token: list[Any], sums: list[_BlockSums]) -> None:
        """Every micro-batch's forward and backward through the copies; the gradients and their magnitudes summed
        in ``sums`` (:class:`_BlockSums`), the losses into ``out``."""
        g = self.groups
        for mb in range(num_microbatches):
            saved: dict[int, tuple[Any, Any]] = {}
            for stage, chunk in g.local_stages(len(self.copies)):
                model = self.copies[chunk]
                g.set_virtual_rank(chunk)
                x = g.stage_input(stage, True)
                _set_input_tensor(model, x)
                if rng is not None:
                    rng.replay(chunk, mb)
                output, loss_func = forward_step_func(iters[chunk], model)
                if stage == stages - 1:
                    result = loss_func(output)
                    loss = result[0]
                    if len(result) == 3:  # per-token loss: (loss sum, num tokens, dict); no division here
                        per_token.append(result[1])
                        out.losses.append(result[2])
                        target = loss
                    else:
                        out.losses.append(result[1])
                        target = loss / num_microbatches
                    if loss_scale != 1.0:
                        target = target * loss_scale
                    saved[stage] = (x, target)
                else:
                    g.send_stage(output.detach(), stage + 1)
                    saved[stage] = (x, output)
            g.backward_stages(saved, stages, lambda chunk: sums[chunk].add_microbatch())

    # -------------------------------------------------------------------------------------------- reductions
    @own_tensor_math
    def _reduce(self, acc: dict[Any, Any], mag: dict[Any, Any], terms: dict[Any, int], per_token: list[Any]
                ) -> None:
        import torch

        g = self.groups
        per_token_mode = self.per_token_loss
        scale = 1.0 if per_token_mode else 1.0 / g.dp_size
        for expert in (False, True):
            group = g.edp if expert else g.dp
            members = [p for p in acc if _is_expert(p) == expert]
            if scale != 1.0:
                for p in members:
                    acc[p].mul_(scale)
                    mag[p].mul_(scale)
            if _group_size(group) > 1 and members:
                _all_reduce_coalesced([acc[p] for p in members] + [mag[p] for p in members], group)
                for p in members:
                    terms[p] *= _group_size(group)
        if g.tp > 1:
            members = [p for p in acc if getattr(p, "sequence_parallel", False)
                       or getattr(p, "average_gradients_across_tp_domain", False)]
            if members:
                _all_reduce_coalesced([acc[p] for p in members] + [mag[p] for p in members], g.tp_group)
            for p in members:
                terms[p] *= g.tp
                if getattr(p, "average_gradients_across_tp_domain", False):
                    acc[p].div_(g.tp)
                    mag[p].div_(g.tp)
        tied = g.tied_weight(self.originals)
        if tied is not None and tied in acc:
            for table in (acc, mag):
                table[tied].add_(g.exchange_tied(table[tied]))
            terms[tied] *= 2
        if per_token_mode:
            local = sum(float(torch.as_tensor(t).sum()) for t in per_token)
            total = g.tokens_over_batch(local)
            for p in acc:
                if total > 0:
                    acc[p].mul_(1.0 / float(total))
                    mag[p].mul_(1.0 / float(total))


def _bf16_up(x: Any) -> Any:
    """``x`` (fp32, non-negative: a sum of magnitudes) rounded up to bfloat16, after a margin of ``2^-20`` for the
    fp32 rounding of the sum: never below the exact value. Held in bf16 while the backward's activations live,
    the magnitudes cost one byte pair per element instead of four bytes (the bound they give grows by at most
    ``2^-7`` of itself)."""
    import torch

    bits = x.mul_(1.0 + 2.0**-20).view(torch.int32)
    return bits.add_(0xFFFF).bitwise_and_(-0x10000).view(torch.float32).to(torch.bfloat16)


@own_tensor_math
def _all_reduce_coalesced(tensors: list[Any], group: Any) -> None:
    """Sum ``tensors`` over ``group``, one collective per dtype (element-wise the same sums as one by one)."""
    import torch
    import torch.distributed as dist

    by_dtype: dict[Any, list[Any]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _unit_roundoff(dtype: Any) -> float:
    import torch

    return {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11,
            torch.float64: 2.0**-53}[dtype]


def _set_input_tensor(model: Any, tensor: Any) -> None:
    """What Megatron's schedule does before every forward: hand the stage its input (``None`` on stage 0)."""
    target = model
    while not hasattr(target, "set_input_tensor") and hasattr(target, "module"):
        target = target.module
    if hasattr(target, "set_input_tensor"):
        target.set_input_tensor([tensor])


def dtype_code(dtype: Any) -> int:
    """A small integer for a dtype sent point-to-point (for the metadata sent ahead of it)."""
    return _DTYPES.index(str(dtype).replace("torch.", ""))


def dtype_of(code: int) -> Any:
    import torch

    return getattr(torch, _DTYPES[code])


def ceil_log2(n: int) -> int:
    """``ceil(log2(n))`` for ``n >= 1``."""
    return max(0, math.ceil(math.log2(max(n, 1))))


#: elements per block of :class:`_BlockSums` (params packed up to it; a larger param is a block of its own)
_SUM_BLOCK = 1 << 26
#: elements per piece of a block's float temporaries (8 bytes each) in :meth:`_BlockSums.add_microbatch`
_SUM_PIECE = 1 << 25


@dataclass
class _SumBlock:
    """Params of one dtype, gradient dtype and device whose sums live in one tensor each (``acc``, ``mag``,
    made at the first gradient); ``spans``: ``(original, copy, lo, hi)``."""

    spans: list[tuple[Any, Any, int, int]]
    numel: int
    acc_dtype: Any
    device: Any
    acc: Any = None
    mag: Any = None


class _BlockSums:
    """The reference's sums over micro-batches in a few kernels per block of params, not ten per param.

    After a micro-batch's backward, each block's copy gradients are concatenated (one kernel; a missing one as
    zeros), added into the block's accumulator (Megatron's gradient dtype) and their magnitudes into its
    magnitude sum (bf16 rounded up on an accelerator, fp32 on the CPU: the same element-wise arithmetic as per
    param), and the copies' gradients are dropped, block by block (memory as per param). A param that got no
    gradient in any micro-batch is left out of ``acc``, as per param; in a micro-batch where only some params of
    a block got one, the others' magnitudes are rounded up once more (a bound larger by at most ``2^-7``)."""

    def __init__(self, pairs: list[tuple[Any, Any]], grad_dtype: Callable[[Any], Any]) -> None:
        self.touched: set[int] = set()
        self.blocks: list[_SumBlock] = []
        by: dict[tuple[Any, Any, Any], list[tuple[Any, Any]]] = {}
        for orig, dup in pairs:
            by.setdefault((dup.dtype, grad_dtype(orig), dup.device), []).append((orig, dup))
        for (_dtype, acc_dtype, device), members in by.items():
            spans: list[tuple[Any, Any, int, int]] = []
            n = 0
            for orig, dup in members:
                k = dup.numel()
                if spans and n + k > _SUM_BLOCK:
                    self.blocks.append(_SumBlock(spans, n, acc_dtype, device))
                    spans, n = [], 0
                spans.append((orig, dup, n, n + k))
                n += k
            if spans:
                self.blocks.append(_SumBlock(spans, n, acc_dtype, device))

    def add_microbatch(self) -> None:
        """Add the copies' gradients of the micro-batch just back-propagated into the sums and drop them."""
        import torch

        for b in self.blocks:
            grads = [dup.grad for _orig, dup, _lo, _hi in b.spans]
            if all(g is None for g in grads):
                continue
            for (_orig, dup, _lo, _hi), g in zip(b.spans, grads, strict=True):
                if g is not None:
                    self.touched.add(id(dup))
            flat = grads[0].reshape(-1) if len(grads) == 1 else torch.cat(
                [(g if g is not None else torch.zeros_like(dup)).reshape(-1)
                 for (_orig, dup, _lo, _hi), g in zip(b.spans, grads, strict=True)])
            for _orig, dup, _lo, _hi in b.spans:
                dup.grad = None
            del grads
            low = b.device.type != "cpu"  # the magnitudes in bf16 rounded up on an accelerator (memory)
            if b.acc is None:
                b.acc = torch.zeros(b.numel, dtype=b.acc_dtype, device=b.device)
                b.mag = torch.zeros(b.numel, dtype=torch.bfloat16 if low else torch.float32, device=b.device)
            for lo in range(0, b.numel, _SUM_PIECE):
                g = flat[lo:lo + _SUM_PIECE]
                b.acc[lo:lo + _SUM_PIECE].add_(g)
                m = b.mag[lo:lo + _SUM_PIECE]
                # abs_ may act on the gradient itself (fp32: .float() is no copy): added above, dropped after
                if low:
                    m.copy_(_bf16_up(m.float().add_(g.float().abs_())))
                else:
                    m.add_(g.float().abs_())
            del flat

    def close(self, acc: dict[Any, Any], mag: dict[Any, Any]) -> None:
        """The sums of the params that got a gradient into ``acc`` and ``mag`` (views of the block sums, by the
        original param; the magnitudes in fp32, converted block by block); the copies' gradients dropped."""
        for b in self.blocks:
            for _orig, dup, _lo, _hi in b.spans:
                dup.grad = None
            if b.acc is None:
                continue
            mags = b.mag.float()
            b.mag = None
            for orig, dup, lo, hi in b.spans:
                if id(dup) in self.touched:
                    acc[orig] = b.acc[lo:hi].view(dup.shape)
                    mag[orig] = mags[lo:hi].view(dup.shape)
            b.acc = None
        self.blocks = []
