"""Gradients checked against the forward: directional derivatives by central finite differences in float64.

:class:`~.reference.PlainReference` (``grads_match_reference``) runs the caller's own layer code, so a fault inside
a layer's hand-written backward (a weight gradient with rows zeroed, a deferred weight gradient that never runs,
a tensor-parallel mapping's backward that leaves out its reduction) acts on it alike. This check does not trust
any backward code. It has two parts, both along seeded random directions:

1. **the backward code against the forward, in float64.** A float64 copy of the caller's modules
   (:func:`float64_copy`: the same layer code, parameters cast exactly from the model's current values, the
   config's ``params_dtype`` float64 and no bf16/fp16 casts, ``Tensor.float()`` of a float64 tensor left in
   float64 while it runs) computes the whole step's loss ``L`` (every micro-batch, each forward replaying the
   random state the real forward of the same micro-batch drew from (:mod:`.rng_replay`), the DP mean, or the
   per-token sum over all tokens) and, by its own backward code (the same hand-written backward functions the
   model runs), its gradient ``g64``. ``<g64, v>`` is compared with ``D(h) = (L(θ+hv) - L(θ-hv)) / 2h`` (``h =
   η·|θ|/|v|``, :data:`ETA`): ``|<g64, v> - D(h)| <= |D(h) - D(2h)| + 2·ε_L/h + k·G64_RHO·|g|``.
   ``|D(h) - D(2h)|`` is 3x the estimate of the central difference's truncation error ``c·h²``; ``2·ε_L/h`` the
   rounding (``ε_L = 2^10·u·|L|``, ``u`` the unit roundoff of the loss's dtype: ``2^-53``, or ``2^-24`` where the
   caller's loss function rounds to float32 in a way the copy cannot keep in float64); :data:`G64_RHO` the float64
   gradient's own rounding. Both sides are float64, so this resolves a change of the backward's result of about
   ``1e-5``-``1e-4`` of ``|g|`` (the fixtures below), whatever the model's dtype: a fault in the backward code
   acts on the copy as it does on the model, and the forward shows it.
2. **the step's gradient against the float64 copy's.** The finalized gradient ``g`` of the step (DDP's
   ``main_grad`` after ``finalize_model_grads``, divided by the loss scale, before the optimizer reads it) against
   ``g64`` weighted as the step weighs it: ``|<g, v> - <g64, v>| <= k·rho·|g|`` (:data:`RHO`: the model dtype's
   relative gradient error, calibrated on clean runs; ``<e, v>`` is N(0, |e|²) for an error ``e`` drawn
   independently of ``v``, so at ``k`` = :data:`K_SIGMA` a correct run fails with probability ~2e-9). This catches
   what acts on the model only (its reduction over ranks, its dtype's path, a forward that reads something else),
   at the model dtype's resolution (``6·rho``: 0.12 of ``|g|`` in bf16, 1.2e-4 in fp32).

Directions: per parameter block (one model parameter) a seeded Gaussian ``v_b`` (i.i.d. N(0,1) elements; one
stream per TP shard of a partitioned parameter, the same on every rank for a replicated one); :data:`DIRECTIONS`
directions ``v`` = all blocks' ``v_b`` together. A fault that changes a gradient by ``f`` shows as ``<f, v>``
(N(0, |f|²)): the report states each part's ``bound / |g|``, the relative change above which a typical direction
sees it. Where a part fails, the failing direction is bisected over the parameter blocks down to single
parameters, which the failure names (part 1 with four float64 forwards for the first half of each node, the second
half's ``D`` by linearity - the node's less the first half's, their bounds added -; part 2 from the sums alone);
``D = 0`` within the bound with ``<g64, v> != 0`` is a forward that does not read the parameter at all.

``loss_matches_float64``: each micro-batch's loss of the real step equals the float64 copy's at the current
parameters within :data:`LOSS_RHO` (relative, per dtype): a forward that computes with something other than
the current parameter (a weight cache not refreshed after a step) is caught even where its gradient is right.

Shared with the code under test: the caller's layer code (forward and backward), in float64. A fault whose effect
is the same in the forward and the backward (a wrong formula the backward differentiates correctly) is not a
gradient fault and is not seen; one that acts in float64 differently from bf16 is seen by part 2 only.

MoE: a router's top-k choice is not a smooth function of the params, and the float64 copy rounds otherwise than
the model (a token whose two best experts are within bf16's rounding routes elsewhere in float64), so the copy's
routers are held at the real step's choices (:mod:`.routing_replay`: every router ``topk`` of the real forward
recorded, the same indices answered in the copy's forwards, with the values gathered from the copy's own scores):
the copy computes the function the step computed, smooth around the current params. Expert params weigh by
their expert-DP replicas; their directions are drawn by global expert index.

Pipeline parallelism (and virtual stages): each rank keeps a float64 copy of each of its chunks; every evaluation
runs the micro-batches through the stages as the plain reference does (:class:`~.reference.PlainReference`: the
activations, and in the backward their gradients, sent point to point in float64, no Megatron communication
code), the loss on the last stage. Blocks are named and their directions drawn by their single-rank names
(global layer numbers), so a direction runs through every stage; the last stage's output layer tied to the
input embedding is moved along the embedding's direction (one param held by two stages: its finalized gradient
counted once, each stage's float64 gradient, a part of the whole, counted in full). The sums are over every
rank's blocks (:attr:`FiniteDifferences.names_all`); ``loss_matches_float64`` is not applicable off the last
stage (no loss there).

Not applicable (each with its reason, never a PASS): MoE routing the copy could not replay (a router call the
real step did not make), context parallelism, TransformerEngine layers (no float64 kernels), dropout whose masks the float64 copy does not
draw as the model's dtype does (probed on the device), an optimizer whose main params cannot be read.

Cost (this is why it is an option, ``check_training_step(..., finite_differences=True)``, recommended once per
run): the float64 copy of this rank's params (8 bytes per element: 4x the param bytes of a bf16 model; its
gradient is never held whole: each param's, per micro-batch, is reduced to its dot products with the directions
as it arrives and freed), one float64 forward and backward of the step's micro-batches and ``1 + 4·DIRECTIONS`` float64
forwards (float64 runs at a fraction of bf16's speed on an accelerator), plus four forwards per bisection node of
a part-1 failure (at most :data:`MAX_BISECT_NODES`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

from ._fd_parts import Block, Eval, bisect, stable
from ._fd_parts import loss_check as loss_check_of
from ._fd_parts import seed as direction_seed
from ._float64 import (
    dropout_reproducible,
    dtype_name,
    float64_copy,
    float_keeps_float64,
    has_dropout,
    inputs_to_float64,
)
from .report import Check

__all__ = ["CALIBRATION", "DIRECTIONS", "ETA", "G64_RHO", "K_SIGMA", "LOSS_RHO", "RHO", "FiniteDifferences",
           "float64_copy"]

#: seeded random directions through all parameter blocks
DIRECTIONS = 2
#: the step's size relative to the parameters: ``h·|v| = ETA·|θ|``
ETA = 2.0**-10
#: standard deviations of ``<e, v>`` the bound allows for the model dtype's gradient error
K_SIGMA = 6.0
#: ``rho``: the model dtype's relative gradient error ``|g - ∇L| / |g|`` (by the model params' dtype), calibrated: the
#: bound's ``K_SIGMA·rho`` is about 10x the largest ``|<g, v> - D| / |g|`` seen on clean runs (:data:`CALIBRATION`;
#: ``<e, v>`` is N(0, |e|²), so that ratio is about ``|e| / |g|``); float16 is not calibrated (4x bf16's precision)
RHO = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 5e-3}
#: relative tolerance of a micro-batch's loss against the float64 copy's, by the model params' dtype (about 10x
#: :data:`CALIBRATION`'s)
LOSS_RHO = {"float32": 2e-7, "bfloat16": 4e-4, "float16": 1e-4}
#: the worst clean ``(|<g, v> - D| / |g|, relative loss error)`` per dtype when :data:`RHO` and :data:`LOSS_RHO`
#: were set (``|<g, v> - <g64, v>| / |g|`` since part 2 compares with the float64 copy's gradient: at most 1.1e-2
#: bf16, 1.9e-7 fp32 on 0.16.1): the user-model fixtures of tests/_own_model_scenarios.py (``fd_step``: DP=2 with the distributed
#: optimizer, TP=2, TP=2 with sequence parallelism; dropout 0.1; after one warm-up step) on 0.4.0, 0.8.0, 0.12.3,
#: 0.16.1 and 0.19.2
CALIBRATION = {"float32": (1.1e-5, 2.3e-8), "bfloat16": (1.2e-2, 4.1e-5)}
#: the float64 copy's gradient's relative rounding error allowed for, next to the finite difference's bound
G64_RHO = 2.0**-30
#: evaluations of ``L`` spent on bisecting a failure at most (four per node)
MAX_BISECT_NODES = 8
#: roundings of the loss's dtype one evaluation of ``L`` is taken to err by
_ROUNDINGS = 2.0**10

_NAME = "grads_match_directional_derivatives"
_LOSS = "loss_matches_float64"


class FiniteDifferences:
    """The check on every rank (collective: every rank calls :meth:`run`).

    Args:
        chunks: this rank's DDP-wrapped model chunks.
        view: the optimizer's main params (:func:`mcore_compat._util.optimizer_view.optimizer_view`).
        groups: this rank's process groups (:class:`~.groups.Groups`).
        names: ``{param: name}`` of the trainable params (:func:`.verify.named_trainable`).
        per_token_loss: the schedule's ``calculate_per_token_loss``.
        seed: the directions' seed.
    """

    def __init__(self, chunks: Sequence[Any], view: Any, groups: Any, names: dict[Any, str],
                 per_token_loss: bool = False, seed: int = 0) -> None:
        self.chunks, self.view, self.groups, self.names = list(chunks), view, groups, names
        self.per_token_loss = per_token_loss
        self.seed = seed
        self.copies: list[Any] = []
        self.routing: Any = None
        self.blocks: list[Block] = []
        #: every rank's blocks by name (a pipeline stage holds its own; the sums are over this list)
        self.names_all: list[str] = []
        self.evaluations = 0
        #: per block, ``<g64_b, v_b^k>`` of each gradient that arrived (:meth:`_dots_hook`), summed in :meth:`_stats`
        self._g64_dots: list[list[Any]] = []

    @property
    def copy(self) -> Any:
        """The float64 copy of the first model chunk while :meth:`run` runs (``None`` otherwise); every chunk's:
        :attr:`copies`."""
        return self.copies[0] if self.copies else None

    # -------------------------------------------------------------------------------------------- applicability
    def unsupported(self, routing: Any = None) -> str | None:
        """Why the check cannot run in this configuration (``None``: it can)."""
        import torch
        import torch.distributed as dist

        from .wrappers import core_module

        g = self.groups
        if self.view.unsupported:
            return f"the optimizer's main params cannot be read: {self.view.unsupported}"
        if any(not getattr(p, "allreduce", True) for p in self.names) and (routing is None or not routing.active):
            return ("MoE experts: the real step's routing choices were not recorded (its forward_step_func was not "
                    "wrapped by StepVerifier.recording), and the float64 copy would route near-tied tokens otherwise")
        if dist.get_world_size() != g.tp * g.dp_size * g.pp:
            return "context parallelism or groups beyond TP x DP x PP"
        for chunk in self.chunks:
            for m in core_module(chunk).modules():
                if "transformer_engine" in type(m).__module__:
                    return f"TransformerEngine's {type(m).__name__} has no float64 kernels"
        first = next(iter(self.names), None)
        if (first is not None and any(has_dropout(c) for c in self.chunks)
                and not dropout_reproducible(first.device, first.dtype)):
            return (f"dropout on {first.device.type}: a float64 tensor draws other masks than a "
                    f"{dtype_name(first.dtype)} one from the same generator state")
        del torch
        return None

    # -------------------------------------------------------------------------------------------- set-up
    def _build(self) -> None:
        from ..binding.placement import coordinates, placements, tp_attrs
        from .wrappers import core_module

        g = self.groups
        self.copies = [float64_copy(c) for c in self.chunks]
        by_model: dict[int, list[Any]] = {}
        for mp in self.view:
            by_model.setdefault(id(mp.model), []).append(mp)
        tied = g.tied_weight(self.chunks)
        coords = coordinates()
        self.blocks = []
        for chunk, dup in zip(self.chunks, self.copies, strict=True):
            core = core_module(chunk)
            places = placements(core)
            mine = dict(dup.named_parameters())
            for name, p in core.named_parameters():
                if p not in self.names:
                    continue
                split = tp_attrs(p)[0]
                place = places[name]
                # a direction per value, the same on every rank holding it: drawn by the param's single-rank name
                # (global layer and expert numbers; the last stage's output layer tied to the input embedding by
                # the embedding's name), per TP shard where split
                where = place.tied_to or place.full_name
                # a rank's sums count a value once over the ranks holding it: the (expert-)DP replicas of the
                # whole param (its main params unless sharded over them by the distributed optimizer), its TP
                # duplicates if replicated, the two pipeline stages of a tied embedding. An expert's param
                # (allreduce=False) lives on the expert-DP replicas of its EP rank, split over the expert TP
                # group (the TP group before 0.11) or duplicated on it
                if place.expert is not None:
                    key = direction_seed(self.seed, stable(where), coords.etp_rank if split else -1)
                    holders, shard = g.edp_size * (1 if split else coords.etp_size), g.edp_size
                else:
                    key = direction_seed(self.seed, stable(where), g.tp_rank if split else -1)
                    holders, shard = g.dp_size * (1 if split else g.tp), g.dp_size
                stages = 2 if tied is not None and p is tied else 1
                self.blocks.append(Block(where, p, mine[name], key, 1.0 / (holders * stages), shard,
                                          by_model.get(id(p), [])))
        from ..launch import gather_objects

        seen: dict[str, int] = {}
        for names in gather_objects([b.name for b in self.blocks]):
            for n in names:
                seen.setdefault(n, len(seen))
        self.names_all = list(seen)
        for b in self.blocks:
            b.index = seen[b.name]

    def _direction(self, block: Block, k: int) -> Any:
        """``v_b^k``, drawn on the param's device (a generator there: a CPU draw of every block, four times per
        evaluation, cost seconds per evaluation on a 0.2B-param model; ranks of one device type draw the same)."""
        import torch

        device = block.param.device
        gen = torch.Generator(device=device).manual_seed(direction_seed(block.seed_key, k))
        return torch.randn(block.param.shape, generator=gen, dtype=torch.float64, device=device)

    # -------------------------------------------------------------------------------------------- evaluations
    def _set(self, subset: Sequence[int], k: int, step: float) -> None:
        """The copy's params at the model's current values plus ``step·v_k`` on the blocks of ``subset``."""
        import torch

        chosen = set(subset)
        with torch.no_grad():
            for b in self.blocks:
                b.copy.copy_(b.param.detach())
                if step and b.index in chosen:
                    b.copy.add_(self._direction(b, k), alpha=step)

    def _forward(self, forward_step_func: Callable[..., Any], iters: list[Any], mb: int, rng: Any,
                 keep: bool) -> tuple[dict[int, tuple[Any, Any]], Any, float | None]:
        """Micro-batch ``mb`` through this rank's stages of the copies (the random state and the routing the real
        forward of each (chunk, micro-batch) had replayed; the activations between stages sent point to point, in
        float64). Returns ``(saved, loss, count)``: per stage its input and output (``keep``: the input requires
        grad, for the backward), the loss tensor on the last stage (``None`` elsewhere) and, for a per-token
        loss, its token count (``None``: a mean the schedule divides by the micro-batches)."""
        import torch

        from .reference import _set_input_tensor

        g = self.groups
        stages = g.pp * len(self.copies)
        saved: dict[int, tuple[Any, Any]] = {}
        loss, count = None, None
        for stage, chunk in g.local_stages(len(self.copies)):
            model = self.copies[chunk]
            g.set_virtual_rank(chunk)
            x = g.stage_input(stage, keep)
            _set_input_tensor(model, x)
            if rng is not None:
                rng.replay(chunk, mb)
            with (self.routing.replaying(model, chunk, mb) if self.routing is not None
                  else contextlib.nullcontext()):
                output, loss_func = forward_step_func(iters[chunk], model)
            if stage == stages - 1:
                result = loss_func(output)
                loss = result[0]
                if len(result) == 3:
                    count = float(torch.as_tensor(result[1]).double().sum())
                saved[stage] = (x, loss)
            else:
                g.send_stage(output.detach(), stage + 1)
                saved[stage] = (x, output)
        return saved, loss, count

    def _loss(self, forward_step_func: Callable[..., Any], batches: Sequence[Sequence[Any] | None],
              num_microbatches: int, rng: Any, per_mb: list[float] | None = None) -> tuple[float, float, str]:
        """This rank's part of the step's loss at the copy's params (``(loss sum, tokens, loss dtype)``; 0 off
        the last pipeline stage; collective over the pipeline)."""
        self.evaluations += 1
        total, tokens, dtype = 0.0, 0.0, "float64"
        iters = [None if b is None else iter(b) for b in batches]
        for mb in range(num_microbatches):
            _, loss, count = self._forward(forward_step_func, iters, mb, rng, keep=False)
            if loss is None:
                continue
            dtype = dtype_name(loss.dtype) if dtype == "float64" else dtype
            value = float(loss.detach().double())
            if count is not None:
                tokens += count
                total += value
                if per_mb is not None:
                    per_mb.append(value / max(count, 1.0))
            else:
                total += value / num_microbatches
                if per_mb is not None:
                    per_mb.append(value)
        self.groups.set_virtual_rank(None)
        return total, tokens, dtype

    def _reduce(self, values: list[float]) -> list[float]:
        """Sum over every rank (float64, one collective)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.groups.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(t)
        return [float(x) for x in t.tolist()]

    def _global_loss(self, pairs: list[tuple[float, float]]) -> list[float]:
        """The step's loss of each evaluation from every rank's ``(sum, tokens)`` (collective)."""
        g = self.groups
        flat = self._reduce([x for pair in pairs for x in pair])
        out = []
        for i in range(len(pairs)):
            s, n = flat[2 * i], flat[2 * i + 1]
            out.append(s / n if self.per_token_loss and n > 0 else s / (g.dp_size * g.tp))
        return out

    # -------------------------------------------------------------------------------------------- the run
    def run(self, forward_step_func: Callable[..., Any], batches: Sequence[Sequence[Any] | None],
            num_microbatches: int, model_losses: Sequence[Any], loss_scale: float, rng: Any,
            routing: Any = None) -> list[Check]:
        """Both checks on this rank (collective); the random state is put back as it was. ``routing``: the
        real step's MoE routing choices (:class:`~.routing_replay.RoutingReplay`), held in the float64 copy."""
        why = self.unsupported(routing)
        if why is not None:
            return [Check.not_applicable(_NAME, why), Check.not_applicable(_LOSS, why)]
        import torch

        from .rng_replay import capture, restore

        self._build()
        self.routing = routing
        left = capture()
        hooks = [inputs_to_float64(c) for c in self.copies]
        try:
            with torch.no_grad(), float_keeps_float64():
                checks = self._run(forward_step_func, [None if b is None else list(b) for b in batches],
                                   num_microbatches, model_losses, loss_scale, rng)
            missed = self._reduce([float(bool(routing is not None and routing.missed))])[0]
            if missed:
                why = ("MoE routing: the float64 copy's router made other top-k calls than the real step's ("
                       + ("; ".join(routing.missed[:2]) if routing is not None and routing.missed else "on a peer rank")
                       + "), so it computed another function")
                return [Check.not_applicable(_NAME, why), Check.not_applicable(_LOSS, why)]
            return checks
        finally:
            for hook in hooks:
                hook.remove()
            restore(left)
            self.copies = []
            self.blocks = []
            self.names_all = []

    def _copy_grads(self, forward_step_func: Callable[..., Any], batches: Sequence[Sequence[Any] | None],
                    num_microbatches: int, rng: Any) -> float:
        """The float64 copy's gradient of this rank's part of the step's loss at the current params, by its own
        backward code (each block's ``copy.grad``; the micro-batches as the schedule weighs them, the random state
        and the routing replayed, through the pipeline's stages and back); returns this rank's token count
        (per-token loss) or 0 (collective through the copy's TP and pipeline communication)."""
        import torch

        self.evaluations += 1
        self._set([], 0, 0.0)
        params = [b.copy for b in self.blocks]
        for q in params:
            q.grad = None
            q.requires_grad_(True)
        # <g64_b, v_b^k> taken as each block's gradient arrives (per micro-batch), the gradient then dropped: no
        # float64 gradient of the whole copy is ever held (8 bytes per element less); torch < 2.1 keeps copy.grad
        self._g64_dots = [[] for _ in self.blocks]
        hooks = [b.copy.register_post_accumulate_grad_hook(self._dots_hook(i, b)) for i, b in enumerate(self.blocks)
                 if hasattr(b.copy, "register_post_accumulate_grad_hook")]
        g = self.groups
        tokens = 0.0
        iters = [None if b is None else iter(b) for b in batches]
        try:
            with torch.enable_grad():
                for mb in range(num_microbatches):
                    saved, _, count = self._forward(forward_step_func, iters, mb, rng, keep=True)
                    if count is not None:
                        tokens += count
                    last = g.pp * len(self.copies) - 1
                    if last in saved:  # the schedule's weight: a per-token sum as it is, a mean over micro-batches
                        x, loss = saved[last]
                        saved[last] = (x, loss.double() if count is not None else loss.double() / num_microbatches)
                    g.backward_stages(saved, last + 1)
        finally:
            for h in hooks:
                h.remove()
            for q in params:
                q.requires_grad_(False)
            g.set_virtual_rank(None)
        return tokens

    def _dots_hook(self, i: int, block: Block) -> Callable[[Any], None]:
        """The hook that adds ``<grad, v_b^k>`` of ``block``'s copy to :attr:`_g64_dots` and frees the gradient."""
        def hook(q: Any) -> None:
            import torch

            grad = q.grad.reshape(-1)
            self._g64_dots[i].append(torch.stack([torch.dot(grad, self._direction(block, k).reshape(-1))
                                                  for k in range(DIRECTIONS)]))
            q.grad = None

        return hook

    def _stats(self, loss_scale: float, kappa: float) -> tuple[list[list[float]], list[list[float]], list[float],
                                                                 list[float], list[list[float]]]:
        """Per block (summed over the ranks): ``<g_b, v_b^k>`` and ``<g64_b, v_b^k>`` for every direction,
        ``|g_b|²``, ``|θ_b|²`` and ``|v_b^k|²`` (collective). ``g64`` is the float64 copy's gradient of this rank's
        loss (its dot products with the directions taken by :meth:`_dots_hook` as it arrived): a TP-partitioned
        param's or a sequence-parallel one's (whose TP ranks each hold a partial gradient) counts once per rank, a replicated one's once per TP group; times ``kappa`` (the step's
        loss from this rank's: ``1/DP``, or ``1/tokens`` of a per-token loss)."""
        import torch

        from ..binding.placement import tp_attrs

        per = 2 + 3 * DIRECTIONS
        local = [0.0] * (per * len(self.names_all))
        for i, b in enumerate(self.blocks):
            gv = [0.0] * DIRECTIONS
            gg = 0.0
            vs = [self._direction(b, k) for k in range(DIRECTIONS)]
            for mp in b.parts:
                grad = mp.finalized_grad()
                if grad is None:
                    continue
                gd = grad.detach().double().reshape(-1) / loss_scale
                w = b.weight * (b.shard if mp.sharded else 1)  # a DP shard: held by this rank only
                for k, v in enumerate(vs):
                    gv[k] += w * float(torch.dot(gd, mp.model_part(v)))
                gg += w * float(torch.dot(gd, gd))
            whole = bool(tp_attrs(b.param)[0]) or bool(getattr(b.param, "sequence_parallel", False))
            m = kappa * (1.0 if whole else 1.0 / self.groups.tp)
            dots = self._g64_dots[i]
            if b.copy.grad is not None:  # no hook (torch < 2.1): the gradient kept whole
                dots = [*dots, torch.stack([torch.dot(b.copy.grad.reshape(-1), v.reshape(-1)) for v in vs])]
            g64v = [m * x for x in torch.stack(dots).sum(0).tolist()] if dots else [0.0] * DIRECTIONS
            theta = b.param.detach().double()
            row = [*gv, *g64v, gg, float((theta * theta).sum()) * b.weight,
                   *(float((v * v).sum()) * b.weight for v in vs)]
            for j, x in enumerate(row):
                local[b.index * per + j] += x
            del vs
        flat = self._reduce(local)
        rows = [flat[i * per:(i + 1) * per] for i in range(len(self.names_all))]
        gv_all = [r[:DIRECTIONS] for r in rows]
        g64v_all = [r[DIRECTIONS:2 * DIRECTIONS] for r in rows]
        gg_all = [r[2 * DIRECTIONS] for r in rows]
        tt_all = [r[2 * DIRECTIONS + 1] for r in rows]
        vv = [r[2 * DIRECTIONS + 2:] for r in rows]
        return gv_all, g64v_all, gg_all, tt_all, vv

    def _run(self, forward_step_func: Callable[..., Any], batches: list[Any], num_microbatches: int,
             model_losses: Sequence[Any], loss_scale: float, rng: Any) -> list[Check]:
        from ._checks.values import loss_value as _loss_value

        g = self.groups
        nb = len(self.names_all)
        tokens = self._copy_grads(forward_step_func, batches, num_microbatches, rng)
        if self.per_token_loss:
            total = self._reduce([tokens])[0] / g.tp  # every TP rank of a group counts its group's tokens
            kappa = 1.0 / total if total > 0 else 0.0
        else:
            kappa = 1.0 / g.dp_size
        gv, g64v, gg, tt, vv = self._stats(loss_scale, kappa)
        for b in self.blocks:
            b.copy.grad = None
        self._g64_dots = []
        dtype = dtype_name(next(iter(self.names)).dtype) if self.names else "float32"
        rho = RHO.get(dtype, RHO["bfloat16"])

        # the loss at θ, per micro-batch, against the real step's
        self._set([], 0, 0.0)
        per_mb: list[float] = []
        self._loss(forward_step_func, batches, num_microbatches, rng, per_mb)
        loss_check = loss_check_of(_LOSS, per_mb, [_loss_value(d) for d in model_losses], dtype,
                                   LOSS_RHO.get(dtype, LOSS_RHO["bfloat16"]))

        def sums(subset: list[int], k: int) -> tuple[float, float, float]:
            gnorm = math.sqrt(sum(gg[i] for i in subset))
            return sum(gv[i][k] for i in subset), sum(g64v[i][k] for i in subset), gnorm

        def compare(subset: list[int], k: int) -> Eval:
            """The model's gradient against the float64 copy's along direction ``k`` on ``subset`` (no forward)."""
            a, b64, gnorm = sums(subset, k)
            return Eval(a, b64, math.nan, 0.0, math.inf, K_SIGMA * rho * gnorm, gnorm)

        def evaluate(subset: list[int], k: int) -> Eval:
            """Direction ``k`` restricted to ``subset``: also the float64 copy's gradient against the central
            difference of its loss (collective: four float64 forwards)."""
            theta = math.sqrt(sum(tt[i] for i in subset))
            vnorm = math.sqrt(sum(vv[i][k] for i in subset))
            h = ETA * max(theta, 1e-30) / max(vnorm, 1e-30)
            pairs = []
            dtypes = []
            for step in (h, -h, 2 * h, -2 * h):
                self._set(subset, k, step)
                s_, n, dt = self._loss(forward_step_func, batches, num_microbatches, rng)
                pairs.append((s_, n))
                dtypes.append(dt)
            lp, lm, l2p, l2m = self._global_loss(pairs)
            d1 = (lp - lm) / (2 * h)
            d2 = (l2p - l2m) / (4 * h)
            u = 2.0**-53 if all(d == "float64" for d in dtypes) else 2.0**-24
            eps = _ROUNDINGS * u * max(abs(lp), abs(lm), abs(l2p), abs(l2m))
            fd_bound = abs(d1 - d2) + 2 * eps / h
            a, b64, gnorm = sums(subset, k)
            return Eval(a, b64, d1, fd_bound, fd_bound + K_SIGMA * G64_RHO * gnorm, K_SIGMA * rho * gnorm, gnorm)

        everything = list(range(nb))
        results = [evaluate(everything, k) for k in range(DIRECTIONS)]
        self._set([], 0, 0.0)
        worst64 = max((abs(r.g64v - r.d) / r.bound64 if r.bound64 > 0 else 0.0) for r in results)
        worst = max((abs(r.gv - r.g64v) / r.dtype_bound if r.dtype_bound > 0 else 0.0) for r in results)
        gnorm = results[0].gnorm
        rel64 = max(abs(r.g64v - r.d) for r in results) / gnorm if gnorm > 0 else 0.0
        rel = max(abs(r.gv - r.g64v) for r in results) / gnorm if gnorm > 0 else 0.0
        resolution64 = max(r.bound64 for r in results) / gnorm if gnorm > 0 else float("inf")
        resolution = max(r.dtype_bound for r in results) / gnorm if gnorm > 0 else float("inf")
        facts = {"worst": max(worst, worst64), "worst_backward": worst64, "worst_dtype": worst, "relative": rel,
                 "relative_backward": rel64, "resolution": resolution, "resolution_backward": resolution64,
                 "evaluations": self.evaluations}
        head = (f"{DIRECTIONS} seeded directions through {nb} parameter blocks: (1) the float64 copy's gradient by "
                f"its backward code vs the central difference of its loss (D(h) vs D(2h), h*|v| = {ETA:.3g}*|params|;"
                f" bound |D(h)-D(2h)| + 2*eps_L/h + {K_SIGMA:g}*{G64_RHO:g}*|g|): worst {worst64:.3g} of the bound "
                f"(|<g64,v> - D| = {rel64:.2g} of |g|, resolution {resolution64:.2g}); (2) the step's finalized "
                f"gradient vs the float64 copy's (bound {K_SIGMA:g}*rho*|g|, rho {rho:g} for {dtype} gradients): "
                f"worst {worst:.3g} of the bound (|<g,v> - <g64,v>| = {rel:.2g} of |g|, resolution {resolution:.2g})")
        failing = [k for k, r in enumerate(results) if r.fails()]
        if not failing:
            detail = f"{head}; {self.evaluations} float64 evaluations of the step"
            return [Check(_NAME, True, detail, facts), loss_check]
        k = failing[0]
        r = results[k]

        def derive(subset: list[int], k: int, parent: Eval, sibling: Eval) -> Eval:
            """``subset``, the parent's blocks less the sibling's, without a forward: ``D`` by linearity
            (the parent's less the sibling's), the two finite-difference bounds added."""
            a, b64, gnorm = sums(subset, k)
            fd = parent.fd_bound + sibling.fd_bound
            return Eval(a, b64, parent.d - sibling.d, fd, fd + K_SIGMA * G64_RHO * gnorm, K_SIGMA * rho * gnorm,
                         gnorm)

        if r.backward_fails():
            named = bisect(self.names_all, evaluate, everything, k, r, derive, MAX_BISECT_NODES)
        else:
            named = bisect(self.names_all, compare, everything, k, r, None, MAX_BISECT_NODES)
        self._set([], 0, 0.0)
        text = "; ".join(named[:6]) + (f"; and {len(named) - 6} more" if len(named) > 6 else "")
        what = ("the backward disagrees with the forward" if r.backward_fails()
                else "the step's gradient disagrees with the float64 copy's")
        detail = f"direction {k}: {r.why()}; {what} on: {text}"
        return [Check(_NAME, False, detail, {**facts, "params": named}), loss_check]


def not_requested() -> list[Check]:
    """Both checks not applicable: not asked for."""
    why = ("off: finite_differences=False (a float64 copy of the params, one float64 backward and 1 + 4x{DIRECTIONS} "
           "float64 forwards of the step; run it once per run)").replace("{DIRECTIONS}", str(DIRECTIONS))
    return [Check.not_applicable(_NAME, why), Check.not_applicable(_LOSS, why)]
