"""Faults inside Megatron-Core itself, for tests/test_megatron_faults.py: each replaces a Megatron function in
the rank's process (never one of mcore_compat's), runs one self-check configuration through it, and records
whether the fault ACTED (the replaced function ran and changed something).

:data:`FAULTS` is the one table: per fault what it simulates, where its target lives on each release (module
and attribute, with the release range and the Megatron file where the target moves or is renamed), the
configuration it is injected into and the checks of which at least one must FAIL. :func:`run_all` runs in every
rank of the test session's warm 2-rank group: for each fault it enters the fault's patch, runs the configuration
with the self-check's own per-rank sweep (:func:`mcore_compat.selfcheck.runner._spawned_sweep`, no new
processes), leaves the patch and returns the verdicts; plus one clean run of every configuration (no fault: the
self-check must pass, so a harness that always fails cannot pass the test).

Faults on collectives never skip a collective on one rank only (its peer would wait forever): the real function
runs on every rank and its effect is undone where the fault acts.
"""

from __future__ import annotations

import importlib
import inspect
import math
import traceback
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

#: Every configuration: the tiny GPT, 2 steps (the state faults act in the second), bf16 params with fp32 main
#: params and fp32 gradient reduction (the setting RL runs use), no binding or offload (not what these test).
COMMON: dict[str, Any] = dict(model="gpt", steps=2, dtype="bf16", bind=False, offload_cycles=0)

#: The configurations the faults are injected into (SelfCheckOptions fields, world size 2).
#: ``dp2``: DP=2 with the distributed optimizer, a constant loss scale of 8 (the release's optimizer then unscales
#: inside its step, as for fp16; a power of two, so exact in bf16) and a clipping threshold far below the tiny
#: GPT's gradient norm (clipping acts in every step).
CONFIGS: dict[str, dict[str, Any]] = {
    "dp2": dict(tp=1, pp=1, distributed_optimizer=True, loss_scale=8.0, clip_grad=1e-3),
    "pp2-tied": dict(tp=1, pp=2, distributed_optimizer=False, tie_embeddings=True),
    "tp2-sp": dict(tp=2, pp=1, sequence_parallel=True, distributed_optimizer=False),
    "tp2": dict(tp=2, pp=1, sequence_parallel=False, distributed_optimizer=False),
    # the caller's model through check_training_step(..., finite_differences=True) after one warm-up step
    # (tests/_own_model_scenarios.fd_step): bf16, lr 1e-6, dropout 0.1, L2 (coupled) weight decay where the release
    # has it (OptimizerConfig.decoupled_weight_decay, 0.15+), the distributed optimizer at DP=2
    "own-dp2": dict(tp=1, pp=1, distributed_optimizer=True, lr=1e-6, dropout=0.1, decoupled_weight_decay=False),
    # fp32 at lr 1e-2: the warm-up step moves the params, so a weight cached at the first forward is stale
    "own-dp2-fp32": dict(tp=1, pp=1, distributed_optimizer=True, dtype="fp32", lr=1e-2),
    # TP=2 without sequence parallelism: where _CopyToModelParallelRegion runs (0.4-0.6: ColumnParallelLinear's
    # input; 0.7+ reduce the input gradient inside the linear layer's backward). With sequence
    # parallelism the tiny GPT never calls _GatherFromSequenceParallelRegion (its layers gather inside
    # LinearWithGradAccumulationAndAsyncCommunication) on 0.4.0, 0.8.0 or 0.16.1, so no fault of it can act here
    "own-tp2": dict(tp=2, pp=1, sequence_parallel=False, distributed_optimizer=False, lr=1e-6, dropout=0.1,
                    decoupled_weight_decay=False),
    # MoE with expert parallelism on the caller's model: 4 experts over EP=2 (DP=2), the all-gather token
    # dispatcher (it gathers the tokens over the EP group: _GatherFromSequenceParallelRegion, 0.10+; its MoE
    # variant before), the routing held at the step's choices in the float64 copy (selfcheck/routing_replay.py)
    "own-moe-ep2": dict(tp=1, pp=1, distributed_optimizer=True, lr=1e-6, dropout=0.1, decoupled_weight_decay=False,
                        experts=4, ep=2),
    # PP=2 with tied embeddings on the caller's model: each stage's float64 copy, the activations sent between
    # the stages; the tied weight's two copies moved along one direction
    "own-pp2": dict(tp=1, pp=2, tie_embeddings=True, distributed_optimizer=True, lr=1e-6, dropout=0.1,
                    decoupled_weight_decay=False),
    # the self-check's own run with finite differences (mcore-compat self-check --finite-differences): TP=2 with
    # sequence parallelism, the distributed optimizer, dropout 0.1 at lr 1e-6
    "fd-tp2-sp": dict(tp=2, pp=1, sequence_parallel=True, distributed_optimizer=True, lr=1e-6, dropout=0.1,
                      finite_differences=True),
}

_OPT = "megatron.core.optimizer.optimizer"
_DIST_OPT = "megatron.core.optimizer.distrib_optimizer"
_DDP = "megatron.core.distributed.distributed_data_parallel"
_FINALIZE = "megatron.core.distributed.finalize_model_grads"
_BUFFER = "megatron.core.distributed.param_and_grad_buffer"
_LAYERS = "megatron.core.tensor_parallel.layers"
#: 0.4/0.5 wheels ship no megatron.core.optimizer: the self-check trains with mcore_compat's own optimizer there
_NO_OPTIMIZER = "ships no megatron.core.optimizer (mcore_compat's own optimizer runs there)"


@dataclass(frozen=True)
class Target:
    """Where a fault's function lives on the releases in ``releases``: ``module``'s ``attr`` (``Class.method``
    for a method), looked up where Megatron's code calls it (a ``from .x import f`` binding lives in the
    importing module)."""

    module: str
    attr: str
    releases: str = ">=0.4"

    def resolve(self) -> tuple[Any, str]:
        """``(owner, name)``: the object whose attribute is replaced (a module or a class) and the name."""
        owner: Any = importlib.import_module(self.module)
        *path, name = self.attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        if name not in vars(owner):
            raise AttributeError(f"{self.module}.{self.attr} does not exist")
        return owner, name


@dataclass
class Record:
    """What a fault saw in this rank: calls of the replaced function and how many times it changed something."""

    calls: int = 0
    acted: int = 0
    notes: list[str] = field(default_factory=list)

    def saw(self, changed: bool, note: str = "") -> None:
        self.calls += 1
        self.acted += bool(changed)
        if changed and note and len(self.notes) < 3:
            self.notes.append(note)


#: make(real, record, target) -> the replacement of ``real``
Maker = Callable[[Callable[..., Any], Record, Target], Callable[..., Any]]


@dataclass(frozen=True)
class MegatronFault:
    """A fault inside Megatron: what it simulates, its targets per release, its configuration and the checks of
    which at least one must FAIL when it acted; ``absent``: why the fault cannot exist outside its targets'
    releases."""

    simulates: str
    targets: tuple[Target, ...]
    make: Maker
    config: str
    must_fail: frozenset[str]
    absent: str = ""


# ----------------------------------------------------------------------------------------------- helpers
def _torch() -> Any:
    import torch

    return torch


def _ps() -> Any:
    from mcore_compat import symbols

    return symbols.resolve("parallel_state")


def _main_grads(modules: Any) -> list[Any]:
    """The ``main_grad`` of every param of ``modules`` (DDP chunks), in registration order."""
    seen: set[int] = set()
    out = []
    for m in modules:
        for p in m.parameters():
            g = getattr(p, "main_grad", None)
            if g is not None and id(p) not in seen:
                seen.add(id(p))
                out.append(g)
    return out


def _undo(grads: list[Any], before: list[Any]) -> bool:
    """Put ``grads`` back to ``before``; whether anything had changed."""
    torch = _torch()
    changed = False
    with torch.no_grad():
        for g, b in zip(grads, before, strict=True):
            if not torch.equal(g, b):
                changed = True
                g.copy_(b)
    return changed


def _bound(real: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> inspect.BoundArguments:
    bound = inspect.signature(real).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


# ----------------------------------------------------------------------------------------------- makers
def _skip_reduction(part: float) -> Maker:
    """DDP's ``finish_grad_sync`` runs, then the last ``part`` of its params (registration order) get their local,
    unreduced gradients back: the reduction of those never happened."""

    def make(real: Callable[..., Any], rec: Record, _t: Target) -> Callable[..., Any]:
        def finish_grad_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
            grads = _main_grads([self])
            grads = grads[len(grads) - math.ceil(len(grads) * part):]
            before = [g.detach().clone() for g in grads]
            out = real(self, *args, **kwargs)
            rec.saw(_undo(grads, before), f"{len(grads)} params kept their local gradients")
            return out

        return finish_grad_sync

    return make


def _sum_not_mean(real: Callable[..., Any], rec: Record, _t: Target) -> Callable[..., Any]:
    """DDP's reduction sums the replicas' gradients instead of averaging them (the 1/DP scaling lost)."""

    def finish_grad_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = real(self, *args, **kwargs)
        dp = _ps().get_data_parallel_world_size()
        if dp > 1:
            for g in _main_grads([self]):
                g.mul_(dp)
        rec.saw(dp > 1, f"gradients x{dp}")
        return out

    return finish_grad_sync


def _stale_gather(real: Callable[..., Any], rec: Record, target: Target) -> Callable[..., Any]:
    """The param all-gather runs, then the last DP rank puts its param buffer back as it was: its copy of the
    other ranks' shards stays at the previous step's values (its own shard was written before the gather)."""

    def gather(self: Any, *args: Any, **kwargs: Any) -> Any:
        ps = _ps()
        last = ps.get_data_parallel_rank() == ps.get_data_parallel_world_size() - 1
        if target.attr.endswith("_dispatch_gather_model_params"):  # 0.6-0.8: (all_gather_handle_index, ...)
            index = _bound(real, (self, *args), kwargs).arguments["all_gather_handle_index"]
            buffers = [self.pbuf_view_items[index][3]]
        else:  # 0.9+: a bucket group's buckets
            buffers = [b.param_data for b in self.buckets if getattr(b, "param_data", None) is not None]
        before = [b.detach().clone() for b in buffers] if last else []
        out = real(self, *args, **kwargs)
        if last:
            rec.saw(_undo(buffers, before), "the last DP rank kept its stale param buffer")
        return out

    return gather


def _skip(real: Callable[..., Any], rec: Record, _t: Target) -> Callable[..., Any]:
    """The function does nothing."""

    def skipped(*args: Any, **kwargs: Any) -> None:
        rec.saw(True)

    return skipped


def _scale_of(opt: Any) -> float:
    scaler = getattr(opt, "grad_scaler", None)
    if scaler is None:
        return 1.0
    scale = scaler.scale
    return float(scale.item() if hasattr(scale, "item") else scale)


def _unscale(times: int) -> Maker:
    """``_unscale_main_grads_and_check_for_nan`` skipped (``times=0``: no overflow reported) or run twice."""

    def make(real: Callable[..., Any], rec: Record, _t: Target) -> Callable[..., Any]:
        def unscale(self: Any) -> Any:
            scale = _scale_of(self)
            rec.saw(scale != 1.0, f"loss scale {scale:g}")
            found = False
            for _ in range(times):
                found = bool(real(self)) or found
            return found

        return unscale

    return make


def _rank_local_norm(own_group: Callable[[], Any]) -> Maker:
    """The grad norm computed over this rank's gradients only (its all-reduce given a group of one rank)."""

    def make(real: Callable[..., Any], rec: Record, _t: Target) -> Callable[..., Any]:
        def norm(*args: Any, **kwargs: Any) -> Any:
            bound = _bound(real, args, kwargs)
            key = next(k for k in bound.arguments if k.endswith("_group"))
            if "max_norm" in bound.arguments:  # 0.6-0.7 clip_grad_norm_fp32 clips too: compare without clipping
                probe = dict(bound.arguments, max_norm=math.inf)
                true = real(**probe)
            else:
                true = real(**bound.arguments)
            bound.arguments[key] = own_group()
            local = real(**bound.arguments)
            rec.saw(float(local) != float(true), f"norm {float(local):.6g} instead of {float(true):.6g}")
            return local

        return norm

    return make


def _coeff(max_norm: float, total: float) -> float:
    return max_norm / (float(total) + 1.0e-6)  # Megatron's clip coefficient (clip_grads.py)


def _clip(times: int) -> Maker:
    """Clipping skipped (``times=0``) or the clip coefficient applied twice."""

    def make(real: Callable[..., Any], rec: Record, target: Target) -> Callable[..., Any]:
        torch = _torch()

        def clip(*args: Any, **kwargs: Any) -> Any:
            bound = _bound(real, args, kwargs)
            a = bound.arguments
            if "total_norm" in a:  # 0.8+: clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, ...)
                coeff = _coeff(a["max_norm"], a["total_norm"])
                rec.saw(coeff < 1.0, f"clip coefficient {coeff:.3g}")
                for _ in range(times):
                    real(**a)
                return None
            # 0.6-0.7: clip_grad_norm_fp32(parameters, grads_for_norm, max_norm, ...) computes the norm and clips
            max_norm = a["max_norm"]
            if times == 0:
                a = dict(a, max_norm=math.inf)
            total = real(**a)
            coeff = _coeff(max_norm, total)
            rec.saw(coeff < 1.0, f"clip coefficient {coeff:.3g}")
            if times == 2 and coeff < 1.0:
                params = a["parameters"]
                params = [params] if isinstance(params, torch.Tensor) else params
                with torch.no_grad():
                    for p in params:
                        if p.grad is not None:
                            p.grad.mul_(coeff)
            return total

        return clip

    return make


def _inner_optimizers(opt: Any) -> list[Any]:
    chained = getattr(opt, "chained_optimizers", None)
    if chained:
        return [i for c in chained for i in _inner_optimizers(c)]
    inner = getattr(opt, "optimizer", None)
    return [inner] if inner is not None and hasattr(inner, "param_groups") else []


_depth = {"n": 0}


def _in_step(corrupt: Callable[[list[Any], Record], Callable[[], None] | None]) -> Maker:
    """Megatron's optimizer step (the outermost of its nested step methods) calls ``corrupt(inner optimizers,
    record)`` before the real step; what ``corrupt`` returns runs after it."""

    def make(real: Callable[..., Any], rec: Record, _t: Target) -> Callable[..., Any]:
        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            if _depth["n"]:
                return real(self, *args, **kwargs)
            _depth["n"] += 1
            try:
                after = corrupt(_inner_optimizers(self), rec)
                out = real(self, *args, **kwargs)
                if after is not None:
                    after()
                return out
            finally:
                _depth["n"] -= 1

        return step

    return make


def _reset_state(inners: list[Any], rec: Record) -> None:
    had = any(len(i.state) for i in inners)
    for i in inners:
        i.state.clear()
    rec.saw(had, "Adam's moments and step counter dropped before the step")


def _freeze_step(inners: list[Any], rec: Record) -> Callable[[], None]:
    torch = _torch()
    before = [(s, s["step"].clone() if isinstance(s["step"], torch.Tensor) else s["step"])
              for i in inners for s in i.state.values() if "step" in s]
    groups = [(g, g["step"]) for i in inners for g in i.param_groups if "step" in g]

    def restore() -> None:
        for s, v in before:
            s["step"] = v
        for g, v in groups:
            g["step"] = v
        rec.saw(bool(before or groups), "the step counter kept its previous value")

    return restore


def _groups_changed(change: Callable[[dict[str, Any]], bool]) -> Callable[[list[Any], Record], Callable[[], None]]:
    """The inner optimizers' param groups changed by ``change`` for the step (restored after it)."""

    def corrupt(inners: list[Any], rec: Record) -> Callable[[], None]:
        saved = [(g, dict(g)) for i in inners for g in i.param_groups]
        changed = [change(g) for g, _ in saved]
        rec.saw(any(changed))

        def restore() -> None:
            for g, old in saved:
                g.clear()
                g.update(old)

        return restore

    return corrupt


def _swap_betas(g: dict[str, Any]) -> bool:
    if "betas" not in g or g["betas"][0] == g["betas"][1]:
        return False
    g["betas"] = (g["betas"][1], g["betas"][0])
    return True


def _maximize(g: dict[str, Any]) -> bool:
    was = bool(g.get("maximize", False))
    g["maximize"] = True
    return not was


def _decay_all(g: dict[str, Any]) -> bool:
    from mcore_compat.selfcheck.options import SelfCheckOptions

    if float(g.get("weight_decay", 0.0)) != 0.0:
        return False
    g["weight_decay"] = SelfCheckOptions.weight_decay  # the configured decay, now on the no-decay group too
    return True


def _reduce_reset(grads_of: Callable[[tuple[Any, ...]], list[Any]]) -> Maker:
    """A finalize_model_grads all-reduce helper runs, then the gradients it changed get their old values back."""

    def make(real: Callable[..., Any], rec: Record, _t: Target) -> Callable[..., Any]:
        def reduce(*args: Any, **kwargs: Any) -> Any:
            grads = grads_of(args)
            before = [g.detach().clone() for g in grads]
            out = real(*args, **kwargs)
            rec.saw(_undo(grads, before), "gradients left unreduced")
            return out

        return reduce

    return make


def _stale_forward(real: Callable[..., Any], rec: Record, _t: Target) -> Callable[..., Any]:
    """Every ColumnParallelLinear with its own weight computes its forward with the weight it had at its first
    forward (a cached copy never refreshed after an optimizer step)."""
    torch = _torch()
    first: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        w = getattr(self, "weight", None)
        if w is None:
            return real(self, *args, **kwargs)
        stale = first.setdefault(self, w.detach().clone())
        if torch.equal(stale, w.detach()):
            rec.saw(False)
            return real(self, *args, **kwargs)
        rec.saw(True, "a ColumnParallelLinear ran with its first weight")
        with torch.no_grad():
            now = w.detach().clone()
            w.data.copy_(stale)
        try:
            return real(self, *args, **kwargs)
        finally:
            with torch.no_grad():
                w.data.copy_(now)

    return forward


def _no_tp_reduction(real: Callable[..., Any], rec: Record, _t: Target) -> Callable[..., Any]:
    """The all-reduce of a row-parallel layer's (and the vocab-parallel embedding's) partial outputs is left out."""

    def reduce_from_tensor_model_parallel_region(input_: Any, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group", args[0] if args else None)
        size = group.size() if group is not None else _ps().get_tensor_model_parallel_world_size()
        rec.saw(size > 1, "each TP rank kept its partial sum")
        return input_

    return reduce_from_tensor_model_parallel_region


def _wgrad(part: float) -> Maker:
    """The linear layers' hand-written backward returns a weight gradient whose first ``part`` of rows is zero
    (``part`` 1: a deferred weight gradient that never runs)."""

    def make(real: Callable[..., Any], rec: Record, _t: Target) -> Callable[..., Any]:
        def backward(ctx: Any, *grads: Any) -> Any:
            out = list(real(ctx, *grads))
            w = out[1]
            rows = math.ceil(w.shape[0] * part) if w is not None and w.dim() else 0
            changed = bool(rows and w[:rows].count_nonzero())
            if changed:
                out[1] = w.clone()
                out[1][:rows] = 0
            rec.saw(changed, f"the first {rows} of {w.shape[0]} weight-gradient rows zero" if changed else "")
            return tuple(out)

        return backward

    return make


def _wgrad_scaled(factor: float) -> Maker:
    """The linear layers' hand-written backward returns its weight gradient times ``factor`` (a wrong scale of
    the gradient accumulation: 1.01 is a 1% error, below the bf16 gradient's bound of the step's comparison)."""

    def make(real: Callable[..., Any], rec: Record, _t: Target) -> Callable[..., Any]:
        def backward(ctx: Any, *grads: Any) -> Any:
            out = list(real(ctx, *grads))
            w = out[1]
            changed = bool(w is not None and w.dim() and w.count_nonzero())
            if changed:
                out[1] = w * factor
            rec.saw(changed, f"a weight gradient times {factor:g}" if changed else "")
            return tuple(out)

        return backward

    return make


def _mapping_unreduced(real: Callable[..., Any], rec: Record, _t: Target) -> Callable[..., Any]:
    """A tensor-parallel mapping's backward leaves out its reduction over the TP group: each rank keeps its own
    partial gradient (``_CopyToModelParallelRegion``'s all-reduce; for a gather's reduce-scatter, a plain split)."""
    torch = _torch()

    def backward(ctx: Any, grad_output: Any, *rest: Any) -> Any:
        local = grad_output.clone()  # the reduction may act in place (0.4-0.5: _reduce all-reduces its input)
        out = real(ctx, grad_output, *rest)
        group = getattr(ctx, "group", None)
        size = group.size() if group is not None else _ps().get_tensor_model_parallel_world_size()
        reduces = getattr(ctx, "tensor_parallel_output_grad", True)  # the gather's split-only branch reduces nothing
        if size <= 1 or not reduces:
            rec.saw(False)
            return out
        first = out[0] if isinstance(out, tuple) else out
        if first.shape == local.shape:  # the copy: all-reduce left out
            mine = local
        else:  # the gather: this rank's slice of its own gradient instead of the reduce-scatter
            rank = group.rank() if group is not None else _ps().get_tensor_model_parallel_rank()
            mine = local.chunk(size, 0)[rank].contiguous()
        rec.saw(not torch.equal(mine, first), "a TP mapping's backward kept this rank's partial gradient")
        return (mine, *out[1:]) if isinstance(out, tuple) else mine

    return backward


def _moe_gather_unreduced(real: Callable[..., Any], rec: Record, t: Target) -> Callable[..., Any]:
    """The token gather's backward over the (tensor and) expert-parallel group keeps this rank's slice of its own
    gradient instead of the reduce-scatter: the gradient of this rank's tokens from the experts of the other
    EP ranks is lost (0.5-0.9's ``_GatherFromSequenceParallelRegionToMOE`` reduces over the group parallel_state
    names; 0.10+'s ``_GatherFromSequenceParallelRegion`` over ``ctx.group``)."""
    if "ToMOE" not in t.attr:
        return _mapping_unreduced(real, rec, t)
    torch = _torch()

    def backward(ctx: Any, grad_output: Any, *rest: Any) -> Any:
        local = grad_output.clone()
        out = real(ctx, grad_output, *rest)
        group = _ps().get_tensor_and_expert_parallel_group()
        first = out[0] if isinstance(out, tuple) else out
        if group.size() <= 1 or first.shape == local.shape:
            rec.saw(False)
            return out
        mine = local.chunk(group.size(), 0)[group.rank()].contiguous()
        rec.saw(not torch.equal(mine, first), "the MoE token gather's backward kept this rank's partial gradient")
        return (mine, *out[1:]) if isinstance(out, tuple) else mine

    return backward


def _combine_grad_scaled(factor: float) -> Maker:
    """The MoE token dispatcher's combine (the expert outputs put back in token order) returns its output
    unchanged but passes the gradient back ``factor`` times too large (a wrong scale in a hand-written backward of
    the dispatch: 1.01 is below the bf16 step's gradient bound)."""

    def make(real: Callable[..., Any], rec: Record, _t: Target) -> Callable[..., Any]:
        torch = _torch()

        class Scaled(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: Any) -> Any:
                return x.view_as(x)

            @staticmethod
            def backward(ctx: Any, grad: Any) -> Any:
                rec.saw(bool(grad.count_nonzero()), f"the combine's gradient times {factor:g}")
                return grad * factor

        def combine(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = real(self, *args, **kwargs)
            if isinstance(out, tuple):
                return (Scaled.apply(out[0]), *out[1:])
            return Scaled.apply(out)

        return combine

    return make


_SINGLE: dict[str, Any] = {}


def _own_group() -> Any:
    return _SINGLE["group"]


def _model_grads(args: tuple[Any, ...]) -> list[Any]:
    """The gradients of a finalize_model_grads helper's ``model`` (its first argument)."""
    return _main_grads(args[0])


# ----------------------------------------------------------------------------------------------- the table
_GRADS = frozenset({"grads_match_reference"})
_RULE = frozenset({"update_matches_optimizer_rule"})
_FINISH = (Target(_DDP, "DistributedDataParallel.finish_grad_sync"),)
#: Megatron's optimizer step: everything in ``step`` on 0.6-0.7; from 0.8 ``step`` = ``prepare_grads`` (unscale),
#: the norm and clipping, then ``step_with_ready_grads`` (the inner optimizer's step, the main-to-model copy).
#: Every class that defines it is wrapped; the outermost call acts (optimizer/optimizer.py, distrib_optimizer.py).
_STEP = (Target(_OPT, "MixedPrecisionOptimizer.step", ">=0.6,<0.8"),
         Target(_OPT, "FP32Optimizer.step", ">=0.6,<0.8"),
         Target(_DIST_OPT, "DistributedOptimizer.step", ">=0.6,<0.8"),
         Target(_OPT, "MixedPrecisionOptimizer.step_with_ready_grads", ">=0.8"),
         Target(_OPT, "FP32Optimizer.step_with_ready_grads", ">=0.8"),
         Target(_DIST_OPT, "DistributedOptimizer.step_with_ready_grads", ">=0.8"))
#: optimizer/optimizer.py imports the clip_grads functions by name: 0.6-0.7 clip_grad_norm_fp32 (norm and clip
#: in one); 0.8+ get_grad_norm_fp32 and clip_grad_by_total_norm_fp32
_NORM = (Target(_OPT, "clip_grad_norm_fp32", ">=0.6,<0.8"), Target(_OPT, "get_grad_norm_fp32", ">=0.8"))
_CLIP = (Target(_OPT, "clip_grad_norm_fp32", ">=0.6,<0.8"), Target(_OPT, "clip_grad_by_total_norm_fp32", ">=0.8"))

#: the finite-difference checks of ``check_training_step(..., finite_differences=True)``
_FD = frozenset({"grads_match_directional_derivatives"})
_LINEAR_BACKWARD = (Target(_LAYERS, "LinearWithGradAccumulationAndAsyncCommunication.backward"),)
_MAPPINGS = "megatron.core.tensor_parallel.mappings"
_DISPATCH = "megatron.core.transformer.moe.token_dispatcher"
_NO_MOE = "0.4 has no MoE token dispatcher (transformer/moe/ arrives in 0.5)"

FAULTS: dict[str, MegatronFault] = {
    "grad_reduction_skipped": MegatronFault(
        "DDP's data-parallel gradient reduction skipped: every rank keeps its own gradients", _FINISH,
        _skip_reduction(1.0), "dp2", _GRADS),
    "grad_reduction_partial": MegatronFault(
        "DDP's gradient reduction stops part-way: the later half of the params keep their local gradients",
        _FINISH, _skip_reduction(0.5), "dp2", _GRADS),
    "grad_sum_not_mean": MegatronFault(
        "DDP's reduction sums the data-parallel replicas' gradients instead of averaging them", _FINISH,
        _sum_not_mean, "dp2", _GRADS),
    "stale_param_gather_one_rank": MegatronFault(
        "the distributed optimizer's param all-gather leaves the last DP rank's copy of the other shards stale",
        # 0.6-0.8 in the optimizer (optimizer/distrib_optimizer.py); 0.9+ in DDP's bucket groups
        # (distributed/param_and_grad_buffer.py)
        (Target(_DIST_OPT, "DistributedOptimizer._dispatch_gather_model_params", ">=0.6,<0.9"),
         Target(_BUFFER, "_ParamAndGradBucketGroup.start_param_sync", ">=0.9")),
        _stale_gather, "dp2", frozenset({"replicas_identical", "model_params_match_main"}),
        absent="has no param all-gather of Megatron's (mcore_compat's own distributed optimizer gathers)"),
    "main_to_model_copy_skipped": MegatronFault(
        "the optimizer's copy of the updated main params into the bf16 model params skipped",
        (Target(_OPT, "Float16OptimizerWithFloat16Params._copy_main_params_to_model_params", ">=0.6"),
         Target(_DIST_OPT, "DistributedOptimizer._copy_main_params_to_model_params", ">=0.6")),
        _skip, "dp2", frozenset({"model_params_match_main", "replicas_identical"}), absent=_NO_OPTIMIZER),
    "unscale_skipped": MegatronFault(
        "the main gradients not divided by the loss scale before the update",
        (Target(_OPT, "MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan", ">=0.6"),),
        _unscale(0), "dp2", frozenset({"update_matches_optimizer_rule", "grad_norm_matches_reference"}),
        absent=_NO_OPTIMIZER),
    "unscale_twice": MegatronFault(
        "the main gradients divided by the loss scale twice",
        (Target(_OPT, "MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan", ">=0.6"),),
        _unscale(2), "dp2", frozenset({"update_matches_optimizer_rule", "grad_norm_matches_reference"}),
        absent=_NO_OPTIMIZER),
    "grad_norm_rank_local": MegatronFault(
        "the gradient norm computed from this rank's gradients only (no all-reduce over the ranks sharing them)",
        _NORM, _rank_local_norm(_own_group), "dp2", frozenset({"grad_norm_matches_reference"}),
        absent=_NO_OPTIMIZER),
    "clip_skipped": MegatronFault(
        "gradient clipping skipped", _CLIP, _clip(0), "dp2", _RULE, absent=_NO_OPTIMIZER),
    "clip_twice": MegatronFault(
        "the clip coefficient applied twice", _CLIP, _clip(2), "dp2", _RULE, absent=_NO_OPTIMIZER),
    "adam_state_reset": MegatronFault(
        "Adam's moments and step counter dropped inside the optimizer step (from the second step on)", _STEP,
        _in_step(_reset_state), "dp2", _RULE, absent=_NO_OPTIMIZER),
    "step_counter_frozen": MegatronFault(
        "Adam's step counter does not advance past its value before the step", _STEP, _in_step(_freeze_step),
        "dp2", _RULE, absent=_NO_OPTIMIZER),
    "betas_swapped": MegatronFault(
        "Adam's betas swapped for the step", _STEP, _in_step(_groups_changed(_swap_betas)), "dp2", _RULE,
        absent=_NO_OPTIMIZER),
    "maximize": MegatronFault(
        "the step goes up the gradient (maximize=True)", _STEP, _in_step(_groups_changed(_maximize)), "dp2",
        _RULE, absent=_NO_OPTIMIZER),
    "decay_every_group": MegatronFault(
        "weight decay applied to every group in the step, the biases' and norms' too", _STEP,
        _in_step(_groups_changed(_decay_all)), "dp2", _RULE, absent=_NO_OPTIMIZER),
    "tied_embedding_allreduce_skipped": MegatronFault(
        "the all-reduce of the tied embedding's gradient between the first and last pipeline stage skipped",
        # 0.4-0.13 called from _allreduce_embedding_grads, 0.14+ from finalize_model_grads itself
        (Target(_FINALIZE, "_allreduce_word_embedding_grads"),), _reduce_reset(_model_grads),
        "pp2-tied", frozenset({"grads_match_reference", "replicas_identical"})),
    "sp_allreduce_skipped": MegatronFault(
        "the all-reduce over TP of the sequence-parallel params' (norms') gradients skipped",
        # renamed in 0.13 (distributed/finalize_model_grads.py keeps the old name as an alias it no longer calls)
        (Target(_FINALIZE, "_allreduce_layernorm_grads", "<0.13"),
         Target(_FINALIZE, "_allreduce_non_tensor_model_parallel_grads", ">=0.13")),
        _reduce_reset(_model_grads), "tp2-sp", frozenset({"grads_match_reference", "replicas_identical"})),
    "stale_weight_in_forward": MegatronFault(
        "a layer's forward uses its weight from the first step (ColumnParallelLinear)",
        (Target(_LAYERS, "ColumnParallelLinear.forward"),), _stale_forward, "dp2",
        frozenset({"independent_reference_matches", "grads_match_reference", "loss_matches_reference"})),
    "missing_tp_output_reduction": MegatronFault(
        "the TP all-reduce of row-parallel outputs left out (tensor_parallel/layers.py's "
        "reduce_from_tensor_model_parallel_region)",
        (Target(_LAYERS, "reduce_from_tensor_model_parallel_region"),), _no_tp_reduction, "tp2",
        frozenset({"independent_reference_matches", "grads_match_reference", "loss_matches_reference",
                   "replicas_identical"})),
    # ---- inside Megatron's layers, caught by check_training_step on the caller's model (tests/_own_model_scenarios)
    "own_wgrad_rows_zeroed": MegatronFault(
        "the linear layers' hand-written backward returns a weight gradient whose first half of rows is zero",
        _LINEAR_BACKWARD, _wgrad(0.5), "own-dp2", _FD),
    "own_wgrad_zero": MegatronFault(
        "the linear layers' backward returns a zero weight gradient (a deferred weight gradient that never runs)",
        _LINEAR_BACKWARD, _wgrad(1.0), "own-dp2", _FD),
    "own_wgrad_scaled_1pct": MegatronFault(
        "the linear layers' backward returns its weight gradient 1% too large (bf16: below the step's gradient "
        "bound, 0.12 of |g|; the float64 copy's backward against its forward resolves about 1e-4)",
        _LINEAR_BACKWARD, _wgrad_scaled(1.01), "own-dp2", _FD),
    "sweep_wgrad_scaled_1pct": MegatronFault(
        "the linear layers' backward returns its weight gradient 1% too large, in the self-check's own run with "
        "--finite-differences (TP=2 with sequence parallelism, bf16, dropout)",
        _LINEAR_BACKWARD, _wgrad_scaled(1.01), "fd-tp2-sp", _FD),
    "own_stale_weight_in_forward": MegatronFault(
        "a ColumnParallelLinear's forward computes with the weight of its first forward (a cache not refreshed "
        "after the warm-up step)",
        (Target(_LAYERS, "ColumnParallelLinear.forward"),), _stale_forward, "own-dp2-fp32",
        frozenset({"grads_match_directional_derivatives", "loss_matches_float64"})),
    "own_copy_to_tp_backward_unreduced": MegatronFault(
        "_CopyToModelParallelRegion's backward leaves out its all-reduce over TP",
        (Target(_MAPPINGS, "_CopyToModelParallelRegion.backward"),), _mapping_unreduced, "own-tp2", _FD),
    "own_missing_tp_output_reduction": MegatronFault(
        "the TP all-reduce of row-parallel outputs left out (the forward and backward agree: the replicas "
        "differ)", (Target(_LAYERS, "reduce_from_tensor_model_parallel_region"),), _no_tp_reduction, "own-tp2",
        frozenset({"replicas_identical", "grads_match_directional_derivatives", "loss_matches_float64"})),
    "own_pp_wgrad_scaled_1pct": MegatronFault(
        "the linear layers' backward returns its weight gradient 1% too large, on the caller's model at PP=2",
        _LINEAR_BACKWARD, _wgrad_scaled(1.01), "own-pp2", _FD),
    "own_pp_tied_embedding_allreduce_skipped": MegatronFault(
        "the all-reduce of the tied embedding's gradient between the first and last pipeline stage skipped, on "
        "the caller's model (the finalized gradient against the float64 copy's two stages)",
        (Target(_FINALIZE, "_allreduce_word_embedding_grads"),), _reduce_reset(_model_grads), "own-pp2", _FD),
    "own_moe_gather_backward_unreduced": MegatronFault(
        "the MoE token dispatcher's gather over the expert-parallel group: its backward leaves out the "
        "reduce-scatter (this rank's tokens lose the gradient from the other rank's experts)",
        (Target(_MAPPINGS, "_GatherFromSequenceParallelRegionToMOE.backward", ">=0.5,<0.10"),
         Target(_MAPPINGS, "_GatherFromSequenceParallelRegion.backward", ">=0.10")),
        _moe_gather_unreduced, "own-moe-ep2", _FD, _NO_MOE),
    "own_moe_combine_grad_scaled": MegatronFault(
        "the MoE token dispatcher's combine passes its gradient back 1% too large (forward unchanged)",
        (Target(_DISPATCH, "MoEDroplessTokenDispatcher.token_unpermutation", ">=0.5,<0.6"),
         Target(_DISPATCH, "MoEAllGatherTokenDispatcher.token_unpermutation", ">=0.6,<0.13"),
         Target(_DISPATCH, "MoEAllGatherTokenDispatcher.token_combine", ">=0.13")),
        _combine_grad_scaled(1.01), "own-moe-ep2", _FD, _NO_MOE),
}


def targets(fault: MegatronFault, version: Any) -> list[Target]:
    """The fault's targets on release ``version``."""
    from mcore_compat._facts.ranges import in_range

    return [t for t in fault.targets if in_range(version, t.releases)]


@contextmanager
def injected(name: str, version: Any) -> Iterator[Record]:
    """Replace the fault's Megatron functions for the duration; yields what the fault saw."""
    fault = FAULTS[name]
    rec = Record()
    replaced = []
    try:
        for t in targets(fault, version):
            owner, attr = t.resolve()
            original = vars(owner)[attr]
            setattr(owner, attr, fault.make(getattr(owner, attr), rec, t))
            replaced.append((owner, attr, original))
        yield rec
    finally:
        for owner, attr, original in reversed(replaced):
            setattr(owner, attr, original)


def options(config: str) -> Any:
    """The resolved SelfCheckOptions of a configuration at world size 2 on CPU (coupled weight decay only where
    the release has it)."""
    from mcore_compat._translate.names import fields_in
    from mcore_compat.detect import detect
    from mcore_compat.selfcheck import SelfCheckOptions

    fields = {**COMMON, **CONFIGS[config]}
    if "decoupled_weight_decay" not in fields_in("OptimizerConfig", detect().version):
        fields.pop("decoupled_weight_decay", None)
    return replace(SelfCheckOptions(**fields), nproc=2, device="cpu").resolved()


def _one(opts: Any, own: bool = False) -> dict[str, Any]:
    import time

    from mcore_compat.selfcheck.runner import _spawned_sweep

    if own:
        import _own_model_scenarios
        from _case_groups import case_end, case_start

        before = case_start()
        try:
            return _own_model_scenarios.fd_step(opts)
        finally:
            case_end(before)

    start = time.perf_counter()
    (checks, _env, tb), = _spawned_sweep([opts])[0]
    return {"checks": checks, "error": tb, "seconds": round(time.perf_counter() - start, 2)}


def run_all() -> dict[str, Any]:
    """On every rank: each configuration clean, then each fault whose targets exist on the release injected into
    its configuration. Returns ``{"version", "clean": {config: result}, "faults": {name: result}}``, a result
    being ``{"checks": [Check], "error": traceback or None, "seconds": float}`` plus, for a fault, ``"calls"``, ``"acted"``,
    ``"notes"`` (or ``"absent"``: why it cannot exist on this release)."""
    import torch.distributed as dist

    from mcore_compat import detect
    from mcore_compat.selfcheck import models

    version = detect().version
    world = dist.get_world_size()
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group, in order
    _SINGLE["group"] = singles[dist.get_rank()]
    out: dict[str, Any] = {"version": str(version), "clean": {}, "faults": {}, "unsupported": {}}
    runnable = {}
    for config in CONFIGS:
        opts = options(config)
        why = models.unsupported_reason(opts)
        if why is not None:
            out["unsupported"][config] = why
            continue
        runnable[config] = opts
        out["clean"][config] = _one(opts, config.startswith("own-"))
    for name, fault in FAULTS.items():
        if fault.config not in runnable:
            out["faults"][name] = {"absent": f"its configuration {fault.config} cannot run: "
                                             f"{out['unsupported'][fault.config]}"}
            continue
        if not targets(fault, version):
            out["faults"][name] = {"absent": fault.absent}
            continue
        try:
            with injected(name, version) as rec:
                result = _one(runnable[fault.config], fault.config.startswith("own-"))
        except Exception:
            result = {"checks": [], "error": traceback.format_exc()}
            rec = Record()
        out["faults"][name] = {**result, "calls": rec.calls, "acted": rec.acted, "notes": rec.notes}
    for g in singles:
        dist.destroy_process_group(g)
    _SINGLE.clear()
    return out
