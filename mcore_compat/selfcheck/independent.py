"""``independent_reference_matches``: the self-check's own model against a float64 model written from the math.

:class:`~.reference.PlainReference` (``grads_match_reference``) runs a copy of the model's Megatron modules: the
same layer code, so it proves DDP, the schedule, ``finalize_model_grads`` and the optimizer's inputs, but a fault
inside Megatron's layers (a stale weight in a linear layer's forward, a missing tensor-parallel reduction, wrong
rows of a weight gradient) acts on both sides alike. This check computes the same step with
:mod:`.plain_gpt` instead (no Megatron code in the forward or backward):

1. after each step's ``forward_backward`` every rank sends its parameters (the values the forward used) with
   Megatron's own parameter attributes (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``) and
   its layers' ``layer_number`` (global: pipeline and virtual-stage offsets included) to every rank;
2. every rank assembles the full, unsharded weights (tensor-parallel shards concatenated along their partition
   dimension, stride-interleaved; replicated params taken once; the tied output-layer copy of the last pipeline
   stage stands for the word embedding) and runs every data-parallel rank's micro-batches
   (:func:`~.models.make_batches` is deterministic per DP rank) through the float64 model: the loss is each
   micro-batch's mean token cross-entropy, divided by the number of micro-batches and averaged over the DP ranks,
   as Megatron's schedule and DDP make it;
3. each micro-batch's loss (last pipeline stage) and each main param's finalized gradient (the slice
   ``_compare_grads`` in :mod:`.verify` compares: this rank's tensor-parallel shard of the full gradient, cut
   by the main param's range, so the distributed optimizer is covered) are compared with the float64 values.

Different kernels and bf16 activations mean no exact bound: the error is relative, per gradient slice
``rms(got - want) / rms(full gradient of that param)`` (floored at 1e-3 of the rms of all gradients) and per loss
``|got - want| / |want|``, against a tolerance per parameter dtype calibrated on clean runs (:data:`TOLERANCE`;
the detail states it and the worst ratio seen). Not applicable (never a FAIL on a correct run) with dropout (the
masks cannot be redrawn identically in float64), MoE experts, and settings :func:`.plain_gpt.unmodelled` names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._util.own_math import own_tensor_math
from ..errors import McoreCompatError
from ..launch import gather_objects
from . import models, plain_gpt
from .options import SelfCheckOptions
from .report import Check
from .wrappers import core_module

__all__ = ["TOLERANCE", "IndependentReference"]

NAME = "independent_reference_matches"

#: (gradient, loss) relative tolerance per parameter dtype: about 7x (bf16) and 8-18x (fp32) the worst clean ratio
#: seen (:data:`CALIBRATION`). The faults of tests/test_independent_reference.py give 0.49-1.4 (gradients).
TOLERANCE = {"fp32": (1e-5, 1e-6), "bf16": (1e-1, 1e-3)}
#: The worst clean (gradient, loss) ratios seen when :data:`TOLERANCE` was set: the standard sweep (2 ranks, 3
#: steps, 2 with dropout) at lr 1e-6 and 1e-2 on 0.4.0, 0.8.0, 0.12.3, 0.16.1 and 0.19.2.
CALIBRATION = {"fp32": (5.4e-7, 1.2e-7), "bf16": (1.5e-2, 1.5e-4)}


@dataclass
class _Local:
    """Where one of this rank's params sits in the full model."""

    key: str
    tp_split: bool
    dim: int
    stride: int


def _tp_info(p: Any) -> tuple[bool, int, int]:
    from ..binding.placement import tp_attrs

    return tp_attrs(p)


def _keys(core: Any) -> dict[Any, str]:
    """``{param: key}``: the single-rank name with Megatron's 1-based ``layer_number`` for a transformer layer's
    local index; the tied output-layer copy (last stage of a pipeline) keyed as the word embedding it stands for
    (:func:`mcore_compat.binding.placement.single_rank_names`, shared with ``gather_full``)."""
    from ..binding.placement import single_rank_names

    return single_rank_names(core, layer_base=1)


def _unshard(shards: Sequence[Any], dim: int, stride: int) -> Any:
    from ..binding.placement import unshard

    return unshard(shards, dim, stride)


def _shard(full: Any, dim: int, stride: int, rank: int, tp: int) -> Any:
    from ..binding.placement import shard

    return shard(full, dim, stride, rank, tp)


def _loss_of(d: Any) -> float | None:
    from ._checks.values import loss_value as _loss_value

    return _loss_value(d)


class IndependentReference:
    """The check on every rank of a self-check run (collective: every rank calls :meth:`step` and :meth:`check`).

    Args:
        opts: the run's resolved options.
        chunks: this rank's DDP-wrapped model chunks.
        config: their TransformerConfig.
        view: the optimizer's main params (:func:`mcore_compat._util.optimizer_view.optimizer_view`).
    """

    def __init__(self, opts: SelfCheckOptions, chunks: Sequence[Any], config: Any, view: Any) -> None:
        from .. import symbols

        self.opts, self.chunks, self.config, self.view = opts, list(chunks), config, view
        ps = symbols.resolve("parallel_state")
        self.tp_rank, self.tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        self.dp_rank, self.dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.dtype = opts.dtype
        self.grad_tol, self.loss_tol = TOLERANCE.get(opts.dtype, TOLERANCE["bf16"])
        self.worst_grad, self.worst_loss, self.where = 0.0, 0.0, ""
        self.failures: list[str] = []
        self.compared = 0
        self.steps = 0
        self.local: dict[Any, _Local] = {}
        self.reason = self._not_applicable_reason()
        if self.reason is None:
            for chunk in self.chunks:
                for p, key in _keys(core_module(chunk)).items():
                    self.local[p] = _Local(key, *_tp_info(p))
            self._layout()
            self._stack_batches()

    def _layout(self) -> None:
        """What every rank will send each step: its params (not the tied output-layer copy), their keys, shapes
        and tensor-parallel attributes (collective, once)."""

        word = "embedding.word_embeddings.weight"
        self.sent = [p for p, loc in self.local.items() if not (loc.key == word and _is_output_copy(p, self.chunks))]
        meta = [(self.local[p].key, tuple(p.shape), self.tp_rank, self.local[p].tp_split, self.local[p].dim,
                 self.local[p].stride) for p in self.sent]
        self.metas: list[Any] = gather_objects(meta)
        self.width = max(sum(math.prod(shape) for _, shape, *_ in m) for m in self.metas)
        self.device = next(iter(self.local)).device

    def _stack_batches(self) -> None:
        """Every DP rank's micro-batches (the same every step), stacked along the batch dimension in the order
        (DP rank, micro-batch): the float64 model runs them in one forward."""
        import torch

        batches = [b for d in range(self.dp) for b in models.make_batches(self.opts, d)]
        self.n_micro = len(batches)
        masks = {b.attention_mask.cpu().numpy().tobytes() for b in batches}
        if len(masks) != 1:
            self.reason = "micro-batches with different attention masks"
            return
        def cat(name: str, dim: int) -> Any:
            return torch.cat([getattr(b, name).cpu() for b in batches], dim)

        self.inputs: tuple[Any, ...]
        if self.opts.model == "gpt":
            self.inputs = (cat("tokens", 0), cat("labels", 0), cat("position_ids", 0),
                           batches[0].attention_mask.cpu())
        else:
            self.inputs = (cat("x", 1).double(), cat("target", 1).double())

    def _not_applicable_reason(self) -> str | None:
        o = self.opts
        if o.dropout:
            return (f"dropout {o.dropout:g}: the masks Megatron draws cannot be redrawn identically by a float64 "
                    f"model (grads_match_reference replays them through the same layers)")
        if o.experts:
            return "MoE experts (routing, token dispatch) are not modelled by the float64 reference"
        if self.view.unsupported:
            return f"the optimizer's main params cannot be read: {self.view.unsupported}"
        if o.model == "mlp":
            return None if (o.pp or 1) == 1 else "the MLP is a single-stage model"
        return plain_gpt.unmodelled(self.config, core_module(self.chunks[0]))

    # --------------------------------------------------------------------------------------------- weights
    def _full_weights(self) -> dict[str, Any]:
        """Every rank's params (one all-gather), assembled into the full float64 weights."""
        import torch
        import torch.distributed as dist

        flat = torch.zeros(self.width, dtype=torch.float64, device=self.device)
        if self.sent:
            mine = torch.cat([p.detach().reshape(-1).double() for p in self.sent])
            flat[:mine.numel()] = mine
        everyone = [torch.empty_like(flat) for _ in self.metas]
        dist.all_gather(everyone, flat)
        by_key: dict[str, dict[int, tuple[Any, bool, int, int]]] = {}
        for meta, data in zip(self.metas, everyone, strict=True):
            data, offset = data.cpu(), 0
            for key, shape, tp_rank, split, dim, stride in meta:
                n = math.prod(shape)
                by_key.setdefault(key, {}).setdefault(tp_rank, (data[offset:offset + n].view(shape), split, dim,
                                                                stride))
                offset += n
        full = {}
        for key, shards in by_key.items():
            _, split, dim, stride = shards[min(shards)]
            if split:
                if sorted(shards) != list(range(self.tp)):
                    raise _NotModelled(f"{key}: tensor-parallel shards {sorted(shards)} of {self.tp}")
                full[key] = _unshard([shards[r][0] for r in range(self.tp)], dim, stride).clone()
            else:
                full[key] = shards[min(shards)][0].clone()
        return full

    # --------------------------------------------------------------------------------------------- the math
    def _reference(self, full: dict[str, Any]) -> tuple[dict[str, Any], list[list[float]]]:
        """Float64 gradients of the whole step's loss and every DP rank's per-micro-batch losses."""
        import torch

        w = {k: t.requires_grad_() for k, t in full.items()}
        cfg = {}
        if self.opts.model == "gpt":
            layers = sorted({int(k.split(".")[2]) for k in w if k.startswith("decoder.layers.")})
            if layers != list(range(1, int(self.config.num_layers) + 1)):
                raise _NotModelled(f"layer numbers {layers} for num_layers={self.config.num_layers}")
            cfg = {**plain_gpt.attention_settings(self.config), "layers": layers,
                   "tied": "output_layer.weight" not in w}
        with torch.enable_grad():
            if self.opts.model == "gpt":
                per_sample = plain_gpt.gpt_token_losses(w, cfg, *self.inputs)  # [n_micro * b, s]
                per_micro = per_sample.reshape(self.n_micro, -1).mean(dim=1)
            else:
                per_sample = plain_gpt.mlp_squared_errors(w, *self.inputs)  # [s, n_micro * b, h]
                s_len, _, h = per_sample.shape
                per_micro = per_sample.reshape(s_len, self.n_micro, -1, h).mean(dim=(0, 2, 3))
            # each micro-batch's mean / micro-batches (the schedule), averaged over the DP ranks (DDP)
            per_micro.sum().div(self.n_micro).backward()
        values = per_micro.detach().tolist()
        m = self.n_micro // self.dp
        losses = [values[d * m:(d + 1) * m] for d in range(self.dp)]
        unused = sorted(k for k, t in w.items() if t.grad is None)
        if unused:
            raise _NotModelled(f"parameters the float64 model does not use: {', '.join(unused[:4])}")
        return {k: t.grad for k, t in w.items()}, losses

    # --------------------------------------------------------------------------------------------- per step
    @own_tensor_math
    def step(self, stored: Sequence[Any], loss_scale: float = 1.0) -> None:
        """After ``forward_backward`` (before the optimizer step): compare this step (collective)."""
        if self.reason is not None:
            return
        try:
            grads, losses = self._reference(self._full_weights())
        except (_NotModelled, KeyError) as exc:
            self.reason = f"the float64 model cannot stand for this model: {exc}"
            return
        for i, (d, want) in enumerate(zip(stored, losses[self.dp_rank], strict=False)):
            got = _loss_of(d)
            if got is None:
                continue
            ratio = abs(got - want) / max(abs(want), 1e-30)
            self.worst_loss = max(self.worst_loss, ratio)
            self.compared += 1
            if ratio > self.loss_tol:
                self._fail(f"step {self.steps} micro-batch {i}: loss {got:.7g} vs float64 {want:.7g} "
                           f"(relative {ratio:.2g})")
        self._compare_grads(grads, loss_scale)
        self.steps += 1

    def _compare_grads(self, grads: dict[str, Any], loss_scale: float) -> None:
        import torch

        n_all = sum(g.numel() for g in grads.values())
        floor = 1e-3 * math.sqrt(sum(float((g * g).sum()) for g in grads.values()) / max(n_all, 1))
        for mp in self.view:
            loc = self.local.get(mp.model)
            got = mp.finalized_grad()
            if loc is None or got is None:
                self._fail(f"step {self.steps}: {mp.name}: no " + ("gradient" if loc else "place in the model"))
                continue
            full = grads[loc.key]
            shard = _shard(full, loc.dim, loc.stride, self.tp_rank, self.tp) if loc.tp_split else full
            want = mp.model_part(shard)
            err = got.detach().double().cpu().reshape(-1) / loss_scale - want
            scale = max(float(full.pow(2).mean().sqrt()), floor, 1e-300)
            ratio = float(err.pow(2).mean().sqrt()) / scale if err.numel() else 0.0
            self.compared += 1
            if ratio > self.worst_grad:
                self.worst_grad, self.where = ratio, f"{mp.name} step {self.steps}"
            if not ratio <= self.grad_tol:  # NaN fails too
                i = int(torch.argmax(err.abs()))
                self._fail(f"step {self.steps}: {mp.name}: relative rms error {ratio:.3g} (e.g. "
                           f"{float(want[i] + err[i]):.6g} vs float64 {float(want[i]):.6g})")

    def _fail(self, what: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(what)

    # --------------------------------------------------------------------------------------------- verdict
    @own_tensor_math
    def check(self) -> Check:
        """This rank's verdict; the worst ratios are those of every rank (collective)."""

        worst = gather_objects((self.worst_grad, self.worst_loss, self.where))
        if self.reason is not None:
            return Check.not_applicable(NAME, self.reason)
        grad, loss, where = max(worst, key=lambda t: t[0])
        loss = max(t[1] for t in worst)
        calib = CALIBRATION.get(self.dtype, (0.0, 0.0))
        text = (f"{self.steps} step(s): losses and finalized gradients vs a float64 plain-PyTorch {self.opts.model} "
                f"(written from the math, full weights gathered from every rank); worst relative error: gradients "
                f"{grad:.3g} ({where}), losses {loss:.3g}; tolerance {self.dtype}: {self.grad_tol:g} / "
                f"{self.loss_tol:g} (worst clean calibration: {calib[0]:.2g} / {calib[1]:.2g})")
        if self.failures:
            return Check(NAME, False, f"{len(self.failures)} failure(s): " + "; ".join(self.failures[:3]) +
                         f" (tolerance {self.grad_tol:g} / {self.loss_tol:g})",
                         {"failures": self.failures, "worst": grad})
        if not self.compared:
            return Check.not_applicable(NAME, "nothing compared on this rank")
        return Check(NAME, True, text, {"worst_grad": grad, "worst_loss": loss, "where": where})


class _NotModelled(McoreCompatError):
    """The gathered model is not one the float64 model stands for."""


def _is_output_copy(p: Any, chunks: Sequence[Any]) -> bool:
    """``p`` is the last pipeline stage's copy of a tied word embedding (its output layer's weight)."""
    for chunk in chunks:
        out = getattr(core_module(chunk), "output_layer", None)
        if out is not None and getattr(out, "weight", None) is p:
            return True
    return False
