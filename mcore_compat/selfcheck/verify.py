"""Verify real training steps, element by element: the engine behind the self-check and
:func:`~mcore_compat.selfcheck.check_training_step`.

Around each step (``zero_grad_buffer``, ``forward_backward``, ``optimizer_step`` through mcore_compat) a
:class:`StepVerifier` proves, on every rank, by induction over the steps:

* ``grads_match_reference``: the finalized gradients (DDP's ``main_grad`` after ``finalize_model_grads``, the
  part the optimizer reads) equal a plain-autograd reference of the same micro-batches at the same weights,
  reduced by hand (:mod:`.reference`), within the bound of reordered sums; with dropout, each reference forward
  replays the random state the real forward of the same chunk and micro-batch started from
  (:mod:`.rng_replay`; wrap the real step's ``forward_step_func`` with :meth:`StepVerifier.recording`), and
  where that cannot reproduce the masks (TransformerEngine's attention dropout) the check is not applicable;
* ``grad_norm_matches_reference``: the norm the optimizer reports equals the norm of those gradients
  recomputed here (tensor-parallel shards once, replicated params once, the tied copy once);
* ``update_matches_optimizer_rule``: every main param and its moments after the step equal the optimizer's
  rule (:mod:`.oracle`, float64) applied to its value and state before the step, the finalized gradient
  (unscaled, clipped by the reported norm) and the hyper-parameters its configuration gives it
  (:mod:`.configured`: the rule, weight decay coupled or decoupled, betas, eps, the no-decay params; never the
  torch optimizer's groups at step time, which a bug inside the step may have changed), within the fp32
  rounding bound; elements a step cannot change must not change;
* ``model_params_match_main``: the model params equal the main params cast to the model dtype, bit for bit;
* ``all_params_changed``: every trainable param's main param (the optimizer's fp32 copy or shard, merged over
  the ranks that share it) changed in the first step;
* ``state_unchanged_between_steps``: nothing touched main params, optimizer state or model params between two
  steps (their fingerprints, :mod:`.fingerprint`, equal);
* ``replicas_identical``: every param replicated over a group is bit-identical over it (data parallel, expert
  data parallel, tensor-parallel duplicates, the tied embedding/output pair);
* ``optimizer_covers_params``: every trainable element is updated by exactly one main param of some group.

Memory: with ``stream=True`` (the self-check and :func:`~mcore_compat.selfcheck.check_training_step`), where the
inner optimizer updates each element on its own, the update is checked inside the optimizer step part by part
(:mod:`.in_step`: a part's main params and state copied at a time; the factor the optimizer's gradients carry,
fitted and compared with the reported norm's; fingerprints proving nothing changed a part after its check).
Otherwise the values the update check needs (main params, optimizer state, finalized gradients) are copied after
the reference has run and freed its gradients (fingerprints prove the forward/backward left the main params and
state alone, and the reference run left the gradients alone), so the copy and the reference never coexist (a
one-step check, ``after_backward(..., last=True)``, also frees the reference copy before the snapshot); the
gradient comparison and the rule run in blocks of :data:`_BLOCK` elements (params of at most :data:`_PACK_MAX`
elements packed together into one evaluation of the rule, their verdicts by segment reductions), each check's
verdicts read with one host sync.

Checks that cannot apply say so (e.g. ``model_params_match_main`` when the model params are the main params).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .._optimizer_view import MainParam, optimizer_view
from .._own_math import own_tensor_math
from ..errors import McoreCompatError
from ..launch import gather_objects
from . import elements, fused
from .configured import Configured, from_optimizer
from .fingerprint import Fingerprint, changed, fingerprints
from .groups import Groups
from .host_snapshot import HostSnapshot
from .in_step import InStep, not_streamable
from .invariants import compare_replicas, global_grad_norm
from .oracle import BOUND_TEXT, Rule, _is_tensor, branches, expected_step, rule_of
from .reference import GradReference, PlainReference
from .report import Check
from .rng_replay import RngReplay, unreplayable_reason
from .routing_replay import RoutingReplay
from .wrappers import core_module

__all__ = ["StepVerifier", "named_trainable"]

#: what of the pre-step snapshot lives in pinned host memory on CUDA (:mod:`.host_snapshot`): ``"main"`` (the
#: main params) and optimizer state keys; the rest (the gradients, the other state) is copied on the device.
#: ``None`` (the default): all on the device where it fits in the device's free memory, else
#: :data:`HOST_WHEN_SHORT` (the device part then costs 4 bytes per param element instead of 16; reading the host
#: part back costs ~8 bytes per element over PCIe: measured on an H200, ``benchmarks/check_step_cost.py``).
HOST_SNAPSHOT: tuple[str, ...] | None = None
HOST_WHEN_SHORT: tuple[str, ...] = ("main", "exp_avg_sq")

_HYPER_KEYS = ("lr", "weight_decay", "betas", "eps", "momentum", "dampening", "nesterov", "amsgrad", "maximize",
               "bias_correction")


def named_trainable(chunks: Sequence[Any]) -> dict[Any, str]:
    """``{param: "<chunk>.<name>"}`` of the trainable params of every chunk (DDP/Float16Module stripped)."""
    out: dict[Any, str] = {}
    for i, chunk in enumerate(chunks):
        for name, p in core_module(chunk).named_parameters():
            if p.requires_grad and p not in out:
                out[p] = f"{i}.{name}"
    return out


#: binary exponents of ``bound / |value|`` the resolution histogram tells apart (float64 spans -1074..1024)
_EXP_RANGE = 1100
#: blocks of more elements than this are counted in the resolution histogram by a systematic sample of about
#: :data:`_RES_SAMPLES` elements (every ``stride``-th, each standing for ``stride`` elements); the samples are kept
#: as values and binned once, when the report is written (the quantiles are stated to a factor of 2 anyway)
_RES_EXACT = 1 << 16
_RES_SAMPLES = 1 << 12


def res_stride(n: int) -> int:
    """The stride of the resolution sample of a block of ``n`` elements (1: every element)."""
    return 1 if n <= _RES_EXACT else max(1, n // _RES_SAMPLES)


def _nonzero(counts: Any) -> list[int]:
    """Indices of the nonzero entries of a 1-d CPU tensor."""
    return [int(i) for i in counts.nonzero().reshape(-1).tolist()]


@dataclass
class _Tally:
    """One check's findings over the steps: the worst element and every failure (step, what)."""

    worst: float = 0.0
    where: str = ""
    elements: int = 0
    failures: list[str] = field(default_factory=list)
    applicable: bool = False
    note: str = ""
    #: elements by the power of two of their bound relative to the param's value (``bound / |p'|``): how small a
    #: deviation from the rule each element could show (:meth:`resolution`)
    resolution_bins: dict[int, int] = field(default_factory=dict)
    _device_bins: Any = None

    def see_resolution_sample(self, rel: Any, weight: int) -> None:
        """Keep ``rel`` (``bound / |value|`` of sampled elements, each standing for ``weight`` elements) on its
        device, for :meth:`resolution` (binned once there: no host sync per block)."""
        if self._device_bins is None:
            self._device_bins = []
        self._device_bins.append((rel, weight))

    def _merge_device_bins(self) -> None:
        import torch

        if not self._device_bins:
            return
        samples, self._device_bins = self._device_bins, None
        rel = torch.cat([r.reshape(-1).double() for r, _w in samples])
        weights = torch.cat([torch.full((r.numel(),), float(w), dtype=torch.float64, device=rel.device)
                             for r, w in samples])
        ok = torch.isfinite(rel) & (rel > 0)
        mantissa, exponent = torch.frexp(torch.where(ok, rel, 1.0))  # rel = mantissa * 2**exponent, 0.5 <= m < 1
        e = (exponent.to(torch.int64) - (mantissa == 0.5).to(torch.int64)).clamp_(-_EXP_RANGE, _EXP_RANGE - 1)
        e = torch.where(ok, e + _EXP_RANGE, 2 * _EXP_RANGE)  # the last bin: left out
        counts = torch.bincount(e, weights=weights, minlength=2 * _EXP_RANGE + 1)[:2 * _EXP_RANGE].cpu()
        for i in _nonzero(counts):
            e_i = i - _EXP_RANGE
            self.resolution_bins[e_i] = self.resolution_bins.get(e_i, 0) + round(float(counts[i]))

    def see_relative(self, rel: float) -> None:
        """Count one element whose bound is ``rel`` of its value."""
        e = math.ceil(math.log2(rel))
        self.resolution_bins[e] = self.resolution_bins.get(e, 0) + 1

    def resolution(self, quantile: float) -> float | None:
        """The relative change per element (``|p'_seen - p'_rule| / |p'|``) below which the check could not have
        told a deviation from rounding, at ``quantile`` of the elements (to a factor of 2, from above)."""
        self._merge_device_bins()
        total = sum(self.resolution_bins.values())
        if not total:
            return None
        seen = 0
        for e in sorted(self.resolution_bins):
            seen += self.resolution_bins[e]
            if seen >= quantile * total:
                return float(2.0**e)
        return None

    def see(self, ratio: float, where: str, n: int) -> None:
        self.applicable = True
        self.elements += n
        if ratio > self.worst:
            self.worst, self.where = ratio, where

    def fail(self, what: str) -> None:
        self.applicable = True
        if len(self.failures) < 50:
            self.failures.append(what)


@dataclass
class _Pre:
    p0: Any
    state0: dict[str, Any]
    group: dict[str, Any] | None
    grad: Any = None


def _clone_state(state: dict[str, Any], copied: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of an optimizer state; ``copied``: entries already copied elsewhere (the host snapshot), taken as
    they are."""
    copied = copied or {}
    out = {}
    for k, v in state.items():
        out[k] = copied[k] if k in copied else (v.detach().clone() if hasattr(v, "detach") else v)
    return out


def _resolution_text(tally: _Tally, what: str = "a main param off the rule") -> str:
    """``"; resolution: ..."``: the smallest relative change per element a check could have seen in this run
    (median and 90th percentile of ``bound / |value|``), so a user can tell whether an effect (weight decay at
    lr 1e-6 moves a param by 1e-7 of its value) was within reach; ``""`` when nothing was compared.

    ``what`` names what deviates (the update check: a main param off the rule; the gradient check: a gradient
    off the reference)."""
    median, high = tally.resolution(0.5), tally.resolution(0.9)
    if median is None or high is None:
        return ""
    return (f"; resolution: {what} by more than {median:.2g} of its value is seen (median "
            f"element; {high:.2g} at the 90th percentile)")


def _pack(entries: list[tuple[Any, ...]], members: list[int], block: int) -> list[list[tuple[int, int, int]]]:
    """Blocks of pieces ``(entry, lo, hi)`` of ``members``' main params, each block <= ``block`` elements:
    a large param in blocks of its own, small ones packed together."""
    blocks: list[list[tuple[int, int, int]]] = []
    open_block: list[tuple[int, int, int]] = []
    size = 0
    for e in members:
        n = entries[e][0].main.numel()
        if n > _PACK_MAX:
            blocks.extend([(e, lo, hi)] for lo, hi in _blocks(n, block))
            continue
        if not n:
            continue
        if size + n > block and open_block:
            blocks.append(open_block)
            open_block, size = [], 0
        open_block.append((e, 0, n))
        size += n
    if open_block:
        blocks.append(open_block)
    return blocks


def _read(scalars: list[Any]) -> list[float]:
    """Device scalars as floats (one host sync per call)."""
    import torch

    if not scalars:
        return []
    return [float(x) for x in torch.stack([x.to(scalars[0].device) for x in scalars]).tolist()]


class StepVerifier:
    """Proves each training step of ``chunks`` with ``optimizer`` (see the module docstring).

    Call :meth:`before_step`, then (after ``forward_backward``) :meth:`after_backward`, then (after
    ``optimizer_step``) :meth:`after_step`, for every step; :meth:`checks` gives the merged verdicts.

    Args:
        chunks: the DDP-wrapped model chunks of this rank.
        optimizer: their optimizer.
        reference: build the plain-autograd copy (one more model in memory) for ``grads_match_reference``.
        continuity: keep exact fingerprints (:mod:`.fingerprint`) of the state after each step to prove nothing
            changed it before the next one (a mismatch says that a param changed, not where).
        per_token_loss: the schedule's ``calculate_per_token_loss``.
        configured: the hyper-parameters the updates must follow (:func:`.configured.from_options`); default:
            :func:`.configured.from_optimizer` (the optimizer's config, the groups' lr and weight decay before
            each step).
        one_step: only one step will be checked: the reference's params are views of the model's weights (its
            run ends before the weights change) instead of a copy of them.
        stream: check the update inside the optimizer's step, part by part (:mod:`.in_step`), instead of from a
            snapshot of all main params and state taken before it; the caller then runs every optimizer step
            within :meth:`stepping`. Where the inner optimizers are not :data:`.in_step.ELEMENTWISE` (or
            ``MCORE_COMPAT_STREAM=0``), the snapshot is taken as without it (:attr:`stream` says which).
    """

    def __init__(self, chunks: Sequence[Any], optimizer: Any, *, reference: bool = True, continuity: bool = True,
                 per_token_loss: bool = False, configured: Configured | None = None, one_step: bool = False,
                 stream: bool = False) -> None:
        import torch

        self.chunks = list(chunks)
        self.optimizer = optimizer
        first = next((p for c in self.chunks for p in c.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.groups = Groups(self.device)
        self.names = named_trainable(self.chunks)
        self.view = optimizer_view(optimizer, self.names)
        self.rules: dict[int, Rule | str] = {id(i): rule_of(i) for i in self.view.inner}
        self.configured: dict[int, Configured | str] = {0: configured} if configured is not None else \
            from_optimizer(optimizer)
        # which main params' groups decay at the start (the build-time param-group rule, before any step)
        self._decays: dict[int, bool] = {
            id(mp): mp.group is not None and float(mp.group.get("wd_mult", 1.0)) != 0.0
            and float(mp.group.get("weight_decay", 0.0)) != 0.0 for mp in self.view}
        self._eps_built: dict[int, float | None] = {
            id(mp): float(mp.group["eps"]) if mp.group is not None and "eps" in mp.group else None for mp in self.view}
        self.continuity = continuity
        self.step_index = 0
        self.tally: dict[str, _Tally] = {k: _Tally() for k in (
            "grads", "norm", "update", "model", "changed", "continuity", "replicas", "loss")}
        self._pre: dict[int, _Pre] = {}
        self._host: HostSnapshot | None = None
        #: elements of each main param (by id) the step changed, counted by the update check
        self._changed: dict[int, Any] = {}
        self._after: dict[int, list[Fingerprint]] = {}
        self._entry: dict[int, list[Fingerprint]] = {}
        self._loss_scale = 1.0
        self.losses_seen: list[float] = []
        self.replica_groups: set[str] = set()
        self.last_clip_coeff = 1.0
        self.rule_text = ""
        self.unchanged: list[str] = []
        self.reference: PlainReference | None = None
        self.reference_bytes = 0
        #: bytes of the last pre-step snapshot on the params' device and (:data:`HOST_SNAPSHOT`) in host memory
        self.snapshot_bytes = 0
        self.snapshot_host_bytes = 0
        self.rng = RngReplay(self.chunks)
        self.routing = RoutingReplay(self.chunks)
        #: why the reference cannot draw the step's dropout masks (then no gradient comparison), or ``None``
        self.unreplayable = unreplayable_reason(self.chunks) if reference else None
        if reference:
            self.reference = PlainReference(self.chunks, self.groups, _grad_dtype, per_token_loss=per_token_loss,
                                            share_weights=one_step)
            self.reference_bytes = self.reference.nbytes()
        self._setup_checks: list[Check] = self._coverage()
        #: why the update is checked from a whole snapshot although ``stream`` was asked for ("" if it streams)
        self.stream_reason = "" if stream else "not asked for"
        if stream and not self.stream_reason:
            if os.environ.get("MCORE_COMPAT_STREAM", "1") == "0":
                self.stream_reason = "MCORE_COMPAT_STREAM=0"
            elif self.view.unsupported:
                self.stream_reason = self.view.unsupported
            else:
                self.stream_reason = next((r for r in (not_streamable(i, optimizer) for i in self.view.inner) if r),
                                          "")
        #: the update is checked inside the optimizer's step (:meth:`stepping`)
        self.stream = not self.stream_reason
        self._in_step = InStep(self._entering_step, self._part_snapshot, self._verify_part)
        self._of_main: dict[int, MainParam] = {id(mp.main): mp for mp in self.view}
        self._grad_prints: dict[int, Fingerprint] = {}
        self._copied_grads: set[int] = set()
        #: per inner optimizer (streamed): the factor its gradients carried (a 0-d device tensor)
        self._scales: dict[int, Any] = {}
        self._verified: dict[int, list[Fingerprint]] = {}
        self._norm_mine: tuple[float, float] | None = None
        self._stepping = False

    @property
    def loss_scale_now(self) -> float:
        """The loss scale of the step being checked (the finalized gradients carry it until the optimizer
        unscales them)."""
        return self._loss_scale

    # ------------------------------------------------------------------------------------------- set-up
    @own_tensor_math
    def _coverage(self) -> list[Check]:
        """``optimizer_covers_params`` and the main params' starting values (equal to the model's)."""

        if self.view.unsupported:
            return [Check.not_applicable("optimizer_covers_params",
                                         f"the optimizer's main params cannot be read: {self.view.unsupported}")]
        owned: dict[str, int] = {}
        sharded: set[str] = set()
        in_no_group: list[str] = []
        for mp in self.view:
            owned[mp.name] = owned.get(mp.name, 0) + mp.main.numel()
            if mp.sharded:
                sharded.add(mp.name)
            if mp.group is None:
                in_no_group.append(mp.name)
        expert_names = {n for p, n in self.names.items() if not getattr(p, "allreduce", True)}
        total = {n: c for n, c in owned.items() if n not in sharded}
        for names, group in ((sharded - expert_names, self.groups.dp), (sharded & expert_names, self.groups.edp)):
            mine = {n: owned[n] for n in names}
            for other in gather_objects(mine, group):
                for n, c in other.items():
                    total[n] = total.get(n, 0) + c
        wrong = [f"{name} ({total.get(name, 0)} of {p.numel()} elements)" for p, name in self.names.items()
                 if total.get(name, 0) != p.numel()]
        compared = [mp for mp in self.view if mp.main is not mp.model]
        differs = _read([_differing(mp) for mp in compared])  # one host sync
        start_diff = [mp.name for mp, n in zip(compared, differs, strict=True) if n]
        bad = wrong + [f"{n} (in no param group)" for n in in_no_group]
        detail = (f"{len(self.names)} trainable params: every element updated by exactly one main param of a param "
                  f"group; the model params equal the main params cast to the model dtype before the step")
        if bad or start_diff:
            detail = ("; ".join(filter(None, [
                f"not covered exactly once: {', '.join(bad[:4])}" if bad else "",
                f"model params differ from the main params before the step: {', '.join(start_diff[:4])}"
                if start_diff else ""])))
        return [Check("optimizer_covers_params", not bad and not start_diff, detail,
                      {"not_covered": bad, "start_differs": start_diff})]

    # ------------------------------------------------------------------------------------------- steps
    def recording(self, forward_step_func: Callable[..., Any]) -> Callable[..., Any]:
        """The ``forward_step_func`` to give the real step: it records the random state before each micro-batch's
        forward, for the reference to replay (the same dropout masks), and a MoE model's routing choices, for the
        float64 copy of :mod:`.directional` (:mod:`.routing_replay`)."""
        return self.routing.recording(self.rng.recording(forward_step_func))

    @own_tensor_math
    def before_step(self) -> None:
        """Prove nothing changed main params, state or model params since the last step (fingerprints), keep the
        param groups' hyper-parameters and fingerprint the main params and state (the values themselves are
        snapshotted after the backward, once the reference has freed its memory)."""
        self._loss_scale = self.view.loss_scale() if not self.view.unsupported else 1.0
        if self.continuity and self._after:
            t = self.tally["continuity"]
            for mp, moved in zip(self.view, self._moved(self._after, model=True), strict=True):
                if moved:
                    t.fail(f"step {self.step_index}: {mp.name} changed between steps")
                t.see(0.0, "", mp.main.numel())
        self._pre = {}
        for mp in self.view:
            self._pre[id(mp)] = _Pre(None, {}, None if mp.group is None else {k: mp.group[k] for k in _HYPER_KEYS
                                                                              if k in mp.group})
        self._entry = self._prints()
        self._changed = {}
        self._scales = {}
        self._verified = {}
        self._norm_mine = None
        if not self.stream:
            self._start_host_snapshot()
        self.rng.start_step()
        self.routing.start_step()

    def _start_host_snapshot(self) -> None:
        """On CUDA, start copying the :data:`HOST_SNAPSHOT` part of the snapshot to the host (it overlaps the
        forward and backward; the values cannot change before the optimizer step, the fingerprints prove it)."""
        self._host = None
        if self.device.type != "cuda" or self.view.unsupported:
            return
        keys = HOST_SNAPSHOT if HOST_SNAPSHOT is not None else self._host_when_short()
        if not keys:
            return
        tensors: dict[Any, Any] = {}
        for mp in self.view:
            if "main" in keys:
                tensors[(id(mp), "main")] = mp.main
            state = _state_of(mp)
            for key in keys:
                if key != "main" and _is_tensor(state.get(key)) and state[key].dim():
                    tensors[(id(mp), key)] = state[key]
        self._host = HostSnapshot(self.device)
        self._host.start(tensors)

    def _host_when_short(self) -> tuple[str, ...]:
        """``()`` if the whole snapshot fits in 90 % of the device memory free now (the forward's activations
        and the reference are gone again when it is taken), else :data:`HOST_WHEN_SHORT`."""
        import torch

        need = 0
        for mp in self.view:
            need += mp.main.numel() * 4 + _nbytes(mp.finalized_grad())
            need += sum(_nbytes(v) for v in _state_of(mp).values() if _is_tensor(v) and v.dim())
        free = torch.cuda.mem_get_info(self.device)[0]
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        headroom = fused.FUSED_BLOCK * 8 * 4  # the update check's block-sized outputs and inputs
        return () if need + headroom <= 0.9 * (free + cached) else HOST_WHEN_SHORT

    @own_tensor_math
    def _prints(self, model: bool = False, mps: Sequence[MainParam] | None = None) -> dict[int, list[Fingerprint]]:
        """Per main param (of ``mps``, default all): fingerprints of its main param and optimizer state (and, with
        ``model``, its model param), all taken together (:func:`.fingerprint.fingerprints`)."""
        items: list[Any] = []
        spans: list[tuple[int, int, int]] = []
        for mp in (self.view if mps is None else mps):
            state = _state_of(mp)
            mine: list[Any] = [tuple(sorted(state))] + [state[k] for k in sorted(state)]
            if not (model and mp.main is mp.model):
                mine.append(mp.main)
            if model:
                mine.append(mp.model_part(mp.model.detach()))
            spans.append((id(mp), len(items), len(items) + len(mine)))
            items.extend(mine)
        prints = fingerprints(items)
        return {k: prints[lo:hi] for k, lo, hi in spans}

    @own_tensor_math
    def _moved(self, before: dict[int, list[Fingerprint]], model: bool = False,
               mps: Sequence[MainParam] | None = None) -> list[bool]:
        """Per main param (of ``mps``, default all, in order): do its fingerprints now differ from ``before``'s?"""
        mps = list(self.view) if mps is None else list(mps)
        now_all = self._prints(model, mps)
        pairs: list[tuple[Fingerprint, Fingerprint]] = []
        spans: list[tuple[int, int, bool]] = []
        for mp in mps:
            now, then = now_all[id(mp)], before[id(mp)]
            spans.append((len(pairs), len(pairs) + min(len(now), len(then)), len(now) != len(then)))
            pairs.extend(zip(then, now, strict=False))
        diff = changed(pairs)
        return [odd or any(diff[lo:hi]) for lo, hi, odd in spans]

    def after_backward(self, forward_step_func: Callable[..., Any] | None, batches: Sequence[Sequence[Any] | None],
                       num_microbatches: int, losses: Sequence[Any] = (), *, last: bool = False) -> None:
        """After ``forward_backward``: check the forward's replicas, compare the gradients (and losses) with the
        reference (collective), then snapshot what the update check needs: the finalized gradients (proven
        unchanged by the reference run), the main params and optimizer state (proven unchanged by the forward
        and backward: equal fingerprints). ``last``: no step follows; the reference copy is freed once it has run,
        before the snapshot (a one-step check)."""
        live = {id(mp): mp.finalized_grad() for mp in self.view}
        self._replicas(f"step {self.step_index}")
        grad_prints: dict[int, Fingerprint] = {}
        compare = self.reference is not None and forward_step_func is not None and not self.unreplayable
        if compare or self.stream:
            keys = [k for k, g in live.items() if g is not None]
            grad_prints = dict(zip(keys, fingerprints([live[k] for k in keys]), strict=True))
        if compare:
            assert self.reference is not None and forward_step_func is not None
            ref = self.reference.run(forward_step_func, batches, num_microbatches, loss_scale=self._loss_scale,
                                     rng=self.rng)
            self._compare_grads(ref, live)
            self._compare_losses(ref, losses)
            del ref
        if last and self.reference is not None:
            self.reference.release()
        del live
        if self.stream:
            self._snapshot_grads(grad_prints)
        else:
            self._snapshot(grad_prints)
        if not self.view.unsupported:  # collective: before the step, on every rank
            self._norm_mine = global_grad_norm(self.view, {k: pre.grad for k, pre in self._pre.items()},
                                               self.groups, self.chunks, self._loss_scale)
        if self._host is not None:
            self._host.fence()  # the optimizer step overwrites what the host copies are read from

    @own_tensor_math
    def _snapshot(self, grad_prints: dict[int, Fingerprint]) -> None:
        """What the update check needs, taken after the reference ran (main params and state proven unchanged by
        the forward and backward; the finalized gradients proven unchanged by the reference run)."""
        for mp, moved in zip(self.view, self._moved(self._entry), strict=True):
            if moved:
                self.tally["update"].fail(f"step {self.step_index}: {mp.name}: main param or optimizer state "
                                          f"changed during forward_backward")
        self.snapshot_bytes = 0
        self.snapshot_host_bytes = 0
        host = self._host.copies if self._host is not None else {}
        for mp in self.view:
            pre = self._pre[id(mp)]
            mine = {key: copy for (owner, key), copy in host.items() if owner == id(mp)}
            pre.p0 = mine.pop("main", None)
            if pre.p0 is None:
                pre.p0 = mp.main.detach().float().clone()
            pre.state0 = _clone_state(_state_of(mp), mine)
            g = mp.finalized_grad()
            pre.grad = None if g is None else g.detach().clone()
            for v in (pre.p0, pre.grad, *pre.state0.values()):
                if _is_tensor(v) and v.device != self.device:
                    self.snapshot_host_bytes += _nbytes(v)
                else:
                    self.snapshot_bytes += _nbytes(v)
        self._grads_unchanged(list(self.view), grad_prints, "while the reference ran")

    def _grads_unchanged(self, mps: list[MainParam], grad_prints: dict[int, Fingerprint], when: str) -> None:
        """The kept finalized gradients (``_pre[...].grad``) of those of ``mps`` fingerprinted in
        ``grad_prints`` still have those fingerprints; a ``grads_match_reference`` failure for each that changed
        (``when``: since when, in words)."""
        kept = [mp for mp in mps if id(mp) in grad_prints]
        pairs = list(zip([grad_prints[id(mp)] for mp in kept], fingerprints([self._pre[id(mp)].grad for mp in kept]),
                         strict=True))
        for mp, moved in zip(kept, changed(pairs), strict=True):
            if moved:
                self.tally["grads"].fail(f"step {self.step_index}: {mp.name}: the finalized gradient changed {when}")

    @own_tensor_math
    def _snapshot_grads(self, grad_prints: dict[int, Fingerprint]) -> None:
        """The finalized gradients a streamed step's checks start from (:attr:`stream`): an fp32 one is copied
        (the optimizer's main gradient is then that same tensor, unscaled and clipped in place), one of another
        dtype is kept as it is (the optimizer reads a float copy of it; :meth:`_entering_step` proves it
        unchanged since it was compared with the reference)."""
        self._grad_prints = grad_prints
        self._copied_grads = set()
        self.snapshot_bytes = 0
        self.snapshot_host_bytes = 0
        for mp in self.view:
            pre = self._pre[id(mp)]
            g = mp.finalized_grad()
            pre.grad = None if g is None else g.detach()
            if g is not None and g.dtype == mp.main.dtype:
                pre.grad = pre.grad.clone()
                self._copied_grads.add(id(mp))
                self.snapshot_bytes += _nbytes(pre.grad)
        self._grads_unchanged([mp for mp in self.view if id(mp) in self._copied_grads], grad_prints,
                              "while the reference ran")

    @contextmanager
    def stepping(self) -> Iterator[None]:
        """Run the step's optimizer step within this (``with verifier.stepping(): optimizer_step(...)``): where
        :attr:`stream`, the inner optimizers' ``step`` is replaced for it (:mod:`.in_step`), else nothing."""
        self._stepping = True
        if not self.stream:
            yield
            return
        with self._in_step.installed(list(self.view.inner)):
            yield

    @own_tensor_math
    def _entering_step(self, inner: Any) -> None:
        """At the start of ``inner``'s step (streamed): its main params and state are those fingerprinted before
        the forward, the finalized gradients kept as they were are those compared with the reference, and the
        gradients it reads are the finalized ones times one factor (read in :meth:`after_step`)."""
        mps = [mp for mp in self.view if mp.inner is inner]
        t = self.tally["update"]
        for mp, moved in zip(mps, self._moved(self._entry, mps=mps), strict=True):
            if moved:
                t.fail(f"step {self.step_index}: {mp.name}: main param or optimizer state changed between the forward "
                       f"and the optimizer's update")
        self._grads_unchanged([mp for mp in mps if id(mp) not in self._copied_grads], self._grad_prints,
                              "after it was compared, before the optimizer read it")
        self._scale_check(inner, mps)

    @own_tensor_math
    def _scale_check(self, inner: Any, mps: list[MainParam]) -> None:
        """The factor the gradients ``inner`` reads (``main.grad``) carry over the finalized ones (Megatron's
        unscaling and clipping): the median ratio of a strided sample (:func:`.elements.scale_sample`), rounded
        to fp32 (the factor applied is an fp32 number). The rule then runs on the finalized gradients times it,
        so an element of the gradient read off that factor shows as an update off the rule; :meth:`after_step`
        compares the factor with the reported norm's and loss scale's."""
        import torch

        t = self.tally["update"]
        grads, used = [], []
        for mp in mps:
            pre = self._pre[id(mp)]
            if pre.grad is None or mp.group is None:
                continue
            if mp.main.grad is None:
                t.fail(f"step {self.step_index}: {mp.name}: the optimizer read no gradient")
                continue
            stride = max(1, pre.grad.numel() // _SCALE_SAMPLES)
            grads.append(pre.grad.reshape(-1)[::stride])
            used.append(mp.main.grad.detach().reshape(-1)[::stride])
        if not grads:
            return
        c = elements.scale_sample(torch.cat(grads), torch.cat(used), 1).nanmedian()
        c = torch.where(torch.isnan(c), torch.ones_like(c), c).float().double()  # every gradient zero: 1
        self._scales[id(inner)] = c

    @own_tensor_math
    def _part_snapshot(self, inner: Any, part: list[Any]) -> dict[int, _Pre]:
        """The pre-update values of one part of ``inner``'s params (streamed): main param and state (the
        finalized gradient is kept for the whole step)."""
        pres: dict[int, _Pre] = {}
        nbytes = 0
        for p in part:
            mp = self._of_main.get(id(p))
            if mp is None or mp.inner is not inner:
                continue
            pre = _Pre(mp.main.detach().float().clone(), _clone_state(_state_of(mp)), self._pre[id(mp)].group,
                       self._pre[id(mp)].grad)
            pres[id(mp)] = pre
            nbytes += sum(_nbytes(v) for v in (pre.p0, *pre.state0.values()) if _is_tensor(v))
        self.snapshot_bytes = max(self.snapshot_bytes, sum(_nbytes(self._pre[k].grad) for k in self._copied_grads)
                                  + nbytes)
        return pres

    @own_tensor_math
    def _verify_part(self, inner: Any, part: list[Any], pres: dict[int, _Pre]) -> None:
        """One part's update against the rule (the finalized gradient times the factor the optimizer's
        gradients carry, :meth:`_scale_check`), then its fingerprints, proven unchanged in :meth:`after_step`."""
        mps = [self._of_main[id(p)] for p in part if id(p) in self._of_main and id(self._of_main[id(p)]) in pres]
        self._verify_update(mps, pres, self._scales.get(id(inner), 1.0), True)
        self._verified.update(self._prints(mps=mps))

    @own_tensor_math
    def after_step(self, update_successful: bool, grad_norm: float | None) -> None:
        """After ``optimizer_step``: the rule, the model params, the first step's changes."""
        if self.stream and not self._stepping:
            raise McoreCompatError("StepVerifier(stream=True): run the optimizer step within "
                                   "`with verifier.stepping():`")
        self._stepping = False
        self._check_norm(grad_norm)
        self._check_update(update_successful, grad_norm)
        self._check_model_params()
        if self.step_index == 0:
            self._check_changed()
        self._pre = {}  # the snapshot is spent: free it before the next step
        if self._host is not None:
            self._host.release()
            self._host = None
        for t in self.tally.values():  # bin this step's resolution samples (one host sync per check and step)
            t._merge_device_bins()
        if self.continuity:
            self._after = self._prints(model=True)
        self.step_index += 1

    @own_tensor_math
    def final_replicas(self) -> None:
        """Check the replicas once more (call when the last step's params are in place on every rank)."""
        self._replicas(f"after step {self.step_index - 1}")

    # ------------------------------------------------------------------------------------------- pieces
    @own_tensor_math
    def _compare_grads(self, ref: GradReference, live: dict[int, Any]) -> None:
        """Every finalized gradient element against the reference's within its bound, in blocks; the verdicts of
        every param read with one host sync (the reference's gradients are kept until then: the backward's
        activations are gone by now, so they add nothing to the peak), the failure example recomputed only for a
        param that failed."""
        import torch

        t = self.tally["grads"]
        compared: list[tuple[MainParam, Any]] = []
        for mp in self.view:
            got = live[id(mp)]
            if got is None:
                t.fail(f"step {self.step_index}: {mp.name} has no gradient")
                continue
            compared.append((mp, got.reshape(-1)))
        ids: list[Any] = []
        worst_parts: list[Any] = []
        over_parts: list[Any] = []
        small: list[int] = []
        size = fused.block_elements(self.device)
        for k, (mp, got) in enumerate(compared):
            if 0 < got.numel() <= _PACK_MAX:
                small.append(k)
                continue
            want_all, bound_all = self._ref_part(ref, mp)
            for lo, hi in _blocks(got.numel(), size):
                self._grad_block(t, [(got[lo:hi], want_all, bound_all, lo, hi)], None, 1, worst_parts, over_parts)
                ids.append(torch.tensor([k], dtype=torch.int64))
        # small params packed (biases, norms): one comparison for many, per-param verdicts by segment reductions
        for start in range(0, len(small), _PACK_COUNT):
            chunk = small[start:start + _PACK_COUNT]
            pieces = []
            for k in chunk:
                mp, got = compared[k]
                want_all, bound_all = self._ref_part(ref, mp)
                pieces.append((got, want_all, bound_all, 0, got.numel()))
            dev = compared[chunk[0]][1].device
            seg = _segments([compared[k][1].numel() for k in chunk], dev)
            self._grad_block(t, pieces, seg, len(chunk), worst_parts, over_parts)
            ids.append(torch.tensor(chunk, dtype=torch.int64))
        values = [0.0, 0.0] * len(compared)
        if ids:
            worst_e, over_e = _per_entry(ids, worst_parts, over_parts, len(compared))
            values = torch.stack([worst_e, over_e], dim=1).reshape(-1).tolist()  # one host sync
        for k, (mp, got) in enumerate(compared):
            worst, over_total = values[2 * k], values[2 * k + 1]
            t.see(worst, f"{mp.name} step {self.step_index}", got.numel())
            if over_total:
                want_all, bound_all = self._ref_part(ref, mp)
                example = ""
                for lo, hi in _blocks(got.numel()):
                    g = got[lo:hi].float()
                    want = torch.zeros_like(g) if want_all is None else want_all[lo:hi].float()
                    bound = torch.zeros_like(g) if bound_all is None else bound_all[lo:hi].float()
                    err = (g - want).abs()
                    if bool((err > bound).any()):
                        i = int(torch.argmax(err - bound))
                        example = (f"e.g. {float(g[i]):.6g} vs {float(want[i]):.6g}, bound "
                                   f"{float(bound[i]):.3g}")
                        break
                t.fail(f"step {self.step_index}: {mp.name}: {int(over_total)}/{got.numel()} elements off "
                       f"({example})")
        ref.grads.clear()
        ref.bounds.clear()

    @staticmethod
    def _grad_block(t: _Tally, pieces: list[tuple[Any, Any, Any, int, int]], seg: Any, n: int,
                    worst_parts: list[Any], over_parts: list[Any]) -> None:
        """Compare one block: ``pieces`` ``(live gradient slice, reference, bound, lo, hi)`` (reference and bound
        whole, ``None`` when the reference has no gradient: zeros), concatenated; appends per piece (segment)
        the worst ``err/bound`` and the elements over it (:func:`.elements.grad_block`)."""
        import torch

        def cat(parts: list[Any]) -> Any:
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        g = cat([p[0] for p in pieces])
        want = cat([torch.zeros(hi - lo, device=g.device) if w is None else w[lo:hi] for _g, w, _b, lo, hi in pieces])
        bound = cat([torch.zeros(hi - lo, device=g.device) if b is None else b[lo:hi] for _g, _w, b, lo, hi in pieces])
        stride = res_stride(g.numel())
        worst, over, sample = fused.run(elements.grad_block, g.device, g, want, bound, seg, n, stride)
        t.see_resolution_sample(sample, stride)
        worst_parts.append(worst)
        over_parts.append(over)

    @staticmethod
    def _ref_part(ref: GradReference, mp: MainParam) -> tuple[Any, Any]:
        """The reference gradient and bound of ``mp``'s part of its model param (``(None, None)`` if none)."""
        full = ref.grads.get(mp.model)
        if full is None:
            return None, None
        return mp.model_part(full), mp.model_part(ref.bounds[mp.model])

    @own_tensor_math
    def _compare_losses(self, ref: GradReference, losses: Sequence[Any]) -> None:
        t = self.tally["loss"]
        if not ref.losses or not losses:
            return
        mine = [_loss_value(d) for d in losses]
        theirs = [_loss_value(d) for d in ref.losses]
        for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
            if a is None or b is None:
                continue
            t.see(0.0 if a == b else float("inf"), f"micro-batch {i}", 1)
            if a != b:
                t.fail(f"step {self.step_index} micro-batch {i}: loss {a:.8g} vs reference {b:.8g}")
        t.note = f"{theirs[0]:.5g}" if theirs and theirs[0] is not None else ""
        known = [x for x in mine if x is not None]
        if known:
            self.losses_seen.append(sum(known) / len(known))

    def _check_norm(self, grad_norm: float | None) -> None:
        t = self.tally["norm"]
        if self.view.unsupported or self._norm_mine is None:
            return
        mine, bound = self._norm_mine
        if grad_norm is None or (grad_norm == 0.0 and not _clip_grad(self.optimizer)):
            # without clipping, releases skip the norm and report None (0.6-0.12) or 0.0 (later)
            t.note = "the optimizer computes no grad norm without clipping (clip_grad = 0)"
            return
        err = abs(grad_norm - mine)
        t.see(err / bound if bound > 0 else (0.0 if err == 0 else float("inf")), f"step {self.step_index}", 1)
        if mine and bound > 0:
            t.see_relative(bound / abs(mine))
        t.note = t.note or f"{grad_norm:.6g} vs {mine:.6g}"
        if err > bound:
            t.fail(f"step {self.step_index}: grad norm {grad_norm:.8g} vs recomputed {mine:.8g} (bound {bound:.3g})")

    def _clip_coeff(self, grad_norm: float | None) -> float:
        clip = _clip_grad(self.optimizer)
        if not clip or grad_norm is None:
            return 1.0
        coeff = clip / (grad_norm + 1.0e-6)
        return coeff if coeff < 1.0 else 1.0

    def _check_update(self, update_successful: bool, grad_norm: float | None) -> None:
        if self.view.unsupported:
            return
        coeff = self._clip_coeff(grad_norm)
        self.last_clip_coeff = coeff
        if self.stream:
            self._after_streamed(update_successful, coeff / self._loss_scale)
        else:
            self._verify_update(list(self.view), self._pre, coeff / self._loss_scale, update_successful)

    @own_tensor_math
    def _after_streamed(self, update_successful: bool, scale: float) -> None:
        """After a streamed step: the factor the optimizer's gradients carried against the reported norm's,
        main params the step did not reach (unchanged where they must be), and what changed after its check."""
        import torch

        t = self.tally["update"]
        reached = [mp for mp in self.view if id(mp) in self._verified]
        if not update_successful or self._in_step.ran == set():
            for mp, moved in zip(self.view, self._moved(self._entry), strict=True):
                t.see(0.0, mp.name, mp.main.numel())
                if moved:
                    t.fail(f"step {self.step_index}: the step was skipped (overflow) but {mp.name} changed"
                           if not update_successful else
                           f"step {self.step_index}: {mp.name} changed, but not by the optimizer's update")
                elif update_successful and mp.group is not None and self._pre[id(mp)].grad is not None:
                    t.fail(f"step {self.step_index}: {mp.name} was not updated: the optimizer's update did not run")
            return
        if self._scales:
            seen_all = torch.stack([c.reshape(()) for c in self._scales.values()]).tolist()  # one host sync
            for seen in seen_all:
                if abs(seen - scale) > _SCALE_TOLERANCE * scale:
                    t.fail(f"step {self.step_index}: the optimizer read the finalized gradients times {seen:.9g}; "
                           f"the reported grad norm and loss scale give {scale:.9g} (clip "
                           f"{_clip_grad(self.optimizer):g}, loss scale {self._loss_scale:g})")
        others = [mp for mp in self.view if id(mp) not in self._verified]
        if others:
            for mp, moved in zip(others, self._moved(self._entry, mps=others), strict=True):
                if mp.group is None:
                    t.fail(f"step {self.step_index}: {mp.name} is in no param group yet changed" if moved else
                           f"step {self.step_index}: {mp.name} is in no param group: never updated")
                elif moved:
                    t.fail(f"step {self.step_index}: {mp.name} changed, but not by the optimizer's update")
                else:
                    t.fail(f"step {self.step_index}: {mp.name} was not updated: the optimizer's update did not "
                           f"reach it")
        if reached:
            for mp, moved in zip(reached, self._moved(self._verified, mps=reached), strict=True):
                if moved:
                    t.fail(f"step {self.step_index}: {mp.name}: main param or optimizer state changed after its "
                           f"update was checked (later in the optimizer's step)")

    def _verify_update(self, mps: list[MainParam], pres: dict[int, _Pre], scale: Any,
                       update_successful: bool) -> None:
        """The rule on ``mps`` (their pre-step values ``pres``; the gradient times ``scale``, a number or a 0-d
        device tensor, is what the optimizer applies), every element, verdicts read with one host sync."""
        import torch

        t = self.tally["update"]
        entries: list[tuple[Any, ...]] = []  # (mp, pre, rule, hyper, now, missing, moment keys, step)
        packs: dict[Any, list[int]] = {}  # main params that may share a block: the same rule, hyper, step, keys
        for mp in mps:
            pre = pres[id(mp)]
            after = mp.main.detach().reshape(-1)
            if pre.group is None:
                if not torch.equal(after.float(), _on(pre.p0, after).reshape(-1)):
                    t.fail(f"step {self.step_index}: {mp.name} is in no param group yet changed")
                else:
                    t.fail(f"step {self.step_index}: {mp.name} is in no param group: never updated")
                continue
            conf = self.configured.get(id(mp.inner), self.configured.get(0))
            if not isinstance(rule_of(mp.inner), Rule) or not isinstance(conf, Configured):
                t.note = f"optimizer rule not modelled: {conf if isinstance(conf, str) else rule_of(mp.inner)}"
                continue
            rule = conf.rule
            hyper = conf.hyper(mp.name, mp.model, pre.group, self._decays.get(id(mp), True),
                               self._eps_built.get(id(mp)))
            bound_key = "adam-l2" if rule.kind == "adam" and not rule.decoupled else rule.kind
            self.rule_text = f"{BOUND_TEXT.get(bound_key, '')}; hyper-parameters: {conf.sources}"
            if not update_successful:
                t.see(0.0, mp.name, after.numel())
                if not torch.equal(after.float(), _on(pre.p0, after).reshape(-1)):
                    t.fail(f"step {self.step_index}: the step was skipped (overflow) but {mp.name} changed")
                continue
            if pre.grad is None:
                t.fail(f"step {self.step_index}: {mp.name} had no gradient to update with")
                continue
            now = _state_of(mp)
            step = int(float(pre.state0["step"])) if "step" in pre.state0 else None
            tensors = tuple(sorted(k for k, v in pre.state0.items() if _is_tensor(v) and v.dim()))
            # the moments the rule gives (:func:`.oracle.expected_step`)
            moments = ["exp_avg", "exp_avg_sq"] if rule.kind == "adam" else (
                ["momentum_buffer"] if hyper.get("momentum") else [])
            missing = {k for k in moments if k not in now}
            pack_key = (rule, tuple(sorted(hyper.items())), step, tensors, tuple(sorted(missing)), after.device)
            packs.setdefault(pack_key, []).append(len(entries))
            entries.append((mp, pre, rule, hyper, now, missing, [k for k in moments if k not in missing], step))
        # every main param's elements in blocks of <= _BLOCK elements; small params packed into one block (one
        # evaluation of the rule for many params, not one each); per-param verdicts by segment reductions
        ids: list[Any] = []
        worst_parts: list[Any] = []
        over_parts: list[Any] = []
        moment_parts: dict[str, list[Any]] = {}
        size = fused.block_elements(self.device)
        for members in packs.values():
            first = entries[members[0]]
            # the numbers as device scalars, once per pack (its blocks share them): the compiled block is then not
            # specialized to lr, scale or step
            scalars = elements.device_scalars({**{f"h.{k}": v for k, v in first[3].items()}, "scale": scale,
                                               "step": _plain(first[1].state0.get("step"))}, first[0].main.device)
            for block in _pack(entries, members, size):
                self._update_block(t, entries, block, scalars, ids, worst_parts, over_parts, moment_parts)
        if not ids:
            return
        n = len(entries)
        worst_e, over_e = _per_entry(ids, worst_parts, over_parts, n)
        dev = worst_e.device
        moment_e = {k: torch.zeros(n, dtype=torch.float64, device=dev).index_add_(
            0, torch.cat([i for i, _ in v]).to(dev, non_blocking=True), torch.cat([o for _, o in v]))
            for k, v in moment_parts.items()}
        values = torch.stack([worst_e, over_e, *moment_e.values()]).cpu()  # one host sync
        keys = list(moment_e)
        for i, (mp, pre, rule, hyper, now, missing, _moments, step) in enumerate(entries):
            numel = mp.main.numel()
            t.see(float(values[0, i]), f"{mp.name} step {self.step_index}", numel)
            over_total = int(values[1, i])
            if over_total:
                t.fail(f"step {self.step_index}: {mp.name}: {over_total}/{numel} elements off the rule "
                       f"({self._update_example(mp, pre, rule, hyper, scale)})")
            for key in sorted(missing):
                t.fail(f"step {self.step_index}: {mp.name}: optimizer state {key} missing")
            for j, key in enumerate(keys):
                o = int(values[2 + j, i])
                if o:
                    t.fail(f"step {self.step_index}: {mp.name}: optimizer state {key} off the rule in {o} "
                           f"elements")
            expected = (step + 1 if step is not None else 1) if rule.kind == "adam" else None
            if expected is not None and "step" in now and int(float(now["step"])) != expected:
                t.fail(f"step {self.step_index}: {mp.name}: optimizer step count {int(float(now['step']))} "
                       f"expected {expected}")

    def _update_block(self, t: _Tally, entries: list[tuple[Any, ...]], block: list[tuple[int, int, int]],
                      scalars: dict[str, Any], ids: list[Any], worst_parts: list[Any], over_parts: list[Any],
                      moment_parts: dict[str, list[Any]]) -> None:
        """The rule on one block (pieces ``(entry, lo, hi)`` of main params that share rule and hyper-parameters,
        :func:`.elements.update_block`): appends, per piece, its worst ``err/bound`` and elements over the bound
        (params and moments) to the lists (device tensors, read together by :meth:`_check_update`). ``scalars``:
        the pack's hyper-parameters (``h.<name>``), ``scale`` and ``step`` as device scalars
        (:func:`.elements.device_scalars`)."""
        import torch

        def cat(parts: list[Any]) -> Any:
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        first = entries[block[0][0]]
        pre0, rule, hyper = first[1], first[2], first[3]
        moments: list[str] = first[6]
        got = cat([entries[e][0].main.detach().reshape(-1)[lo:hi] for e, lo, hi in block])
        p0 = _on(cat([entries[e][1].p0.reshape(-1)[lo:hi] for e, lo, hi in block]), got)
        grad = cat([entries[e][1].grad.reshape(-1)[lo:hi] for e, lo, hi in block])
        state0 = {k: (_on(cat([entries[e][1].state0[k].reshape(-1)[lo:hi] for e, lo, hi in block]), got)
                      if _is_tensor(v) and v.dim() else _plain(v)) for k, v in pre0.state0.items()}
        now = {key: cat([entries[e][4][key].detach().reshape(-1)[lo:hi] for e, lo, hi in block]) for key in moments}
        seg = None
        if len(block) > 1:
            seg = _segments([hi - lo for _e, lo, hi in block], p0.device)
        ids.append(torch.tensor([e for e, _lo, _hi in block], dtype=torch.int64))
        stride = res_stride(p0.numel())
        present = branches(rule, hyper)
        hyper = {k: scalars[f"h.{k}"] for k in hyper}
        if "step" in state0:
            state0["step"] = scalars["step"]
        worst, over, moment_over, changed, sample = fused.run(
            elements.update_block, p0.device, elements.canonical(rule), hyper, p0, grad, scalars["scale"], state0,
            got, now, seg, len(block), stride, present)
        t.see_resolution_sample(sample, stride)
        for k, (e, _lo, _hi) in enumerate(block):
            mp_id = id(entries[e][0])
            self._changed[mp_id] = self._changed.get(mp_id, 0) + changed[k]
        for key, o in moment_over.items():
            moment_parts.setdefault(key, []).append((ids[-1], o))
        worst_parts.append(worst)
        over_parts.append(over)

    def _expected_block(self, mp: MainParam, pre: _Pre, rule: Rule, hyper: dict[str, Any], scale: Any, lo: int,
                        hi: int) -> tuple[Any, dict[str, Any], Any, Any]:
        """The rule on elements ``lo:hi`` of ``mp``: ``(p', state', bound, the main param seen)`` (float64)."""
        p0 = _on(pre.p0.reshape(-1)[lo:hi], pre.grad)
        grad = pre.grad.reshape(-1)[lo:hi].double() * scale
        state0 = {k: (_on(v.reshape(-1)[lo:hi], pre.grad) if _is_tensor(v) and v.dim() else v)
                  for k, v in pre.state0.items()}
        p1, state1, bound = expected_step(rule, hyper, p0, grad, state0)
        return p1, state1, bound, mp.main.detach().reshape(-1)[lo:hi].double()

    def _update_example(self, mp: MainParam, pre: _Pre, rule: Rule, hyper: dict[str, Any], scale: Any) -> str:
        """The first element of ``mp`` off the rule, in words (the failure path: the blocks recomputed)."""
        import torch

        for lo, hi in _blocks(mp.main.numel()):
            p1, _state1, bound, got = self._expected_block(mp, pre, rule, hyper, scale, lo, hi)
            err = (got - p1).abs()
            if bool((err > bound).any()):
                i = int(torch.argmax(err - bound))
                return (f"e.g. {float(got[i]):.9g} vs {float(p1[i]):.9g} from {float(pre.p0.reshape(-1)[lo + i]):.9g}"
                        f", bound {float(bound[i]):.3g}")
        return ""

    def _check_model_params(self) -> None:
        t = self.tally["model"]
        compared = [mp for mp in self.view if mp.main is not mp.model]
        for mp, n in zip(compared, _read([_differing(mp) for mp in compared]), strict=True):  # one host sync
            t.see(0.0, mp.name, mp.main.numel())
            if n:
                t.fail(f"step {self.step_index}: {mp.name}: {int(n)}/{mp.main.numel()} elements differ from the main "
                       f"params cast to {str(mp.model.dtype).replace('torch.', '')}")

    def _check_changed(self) -> None:

        t = self.tally["changed"]
        if self.view.unsupported:
            return
        per_mp: list[Any] = []
        for mp in self.view:  # counted by the update check where it ran the rule, else here
            n = self._changed.get(id(mp))
            if n is None and self.stream:
                n = mp.main.new_zeros(())
            elif n is None:
                pre = self._pre[id(mp)]
                after = mp.main.detach().float().reshape(-1)
                n = (after != _on(pre.p0, after).reshape(-1)).sum()
            per_mp.append(n.reshape(()).double())
        counts: dict[str, int] = {}
        for mp, n in zip(self.view, _read(per_mp), strict=True):  # one host sync
            counts[mp.name] = counts.get(mp.name, 0) + int(n)
        merged: dict[str, int] = {}
        for group in {id(self.groups.dp): self.groups.dp, id(self.groups.edp): self.groups.edp}.values():
            for other in gather_objects(counts, group):
                for n, c in other.items():
                    merged[n] = merged.get(n, 0) + c
        unchanged = [n for n in self.names.values() if merged.get(n, 0) == 0]
        t.applicable = True
        t.elements = len(self.names)
        self.unchanged = unchanged
        for n in unchanged:
            t.fail(n)

    @own_tensor_math
    def _replicas(self, when: str) -> None:
        """Every replicated param bit-identical over its group (collective)."""
        result = compare_replicas(self.groups, self.names, self.chunks, when)
        t = self.tally["replicas"]
        if result.labels:
            t.see(0.0, when, result.elements)
        self.replica_groups |= result.labels
        for failure in result.failures:
            t.fail(failure)

    # ------------------------------------------------------------------------------------------- verdicts
    @own_tensor_math
    def checks(self) -> list[Check]:
        """The verdicts of this rank (merge over ranks with :func:`~.report.merge_rank_checks`)."""
        out = list(self._setup_checks)
        steps = self.step_index
        tl = self.tally
        if self.reference is None:
            out.append(Check.not_applicable("grads_match_reference", "no reference copy (reference=False)"))
        elif self.unreplayable:
            out.append(Check.not_applicable("grads_match_reference", self.unreplayable))
        else:
            out.append(_verdict("grads_match_reference", tl["grads"],
                                f"{steps} step(s): finalized gradients vs a plain-autograd reference, worst "
                                f"{tl['grads'].worst:.3g} of the bound 2(k-1)u*sum|terms| "
                                f"({tl['grads'].where or 'every element equal'})"
                                + _resolution_text(tl["grads"], "a gradient off the reference"),
                                "no gradient on this rank"))
        norm_na = self.view.unsupported or (not tl["norm"].applicable and tl["norm"].note)
        if norm_na:
            out.append(Check.not_applicable("grad_norm_matches_reference",
                                            tl["norm"].note or f"optimizer not readable: {self.view.unsupported}"))
        else:
            out.append(_verdict("grad_norm_matches_reference", tl["norm"],
                                f"reported vs recomputed norm {tl['norm'].note} (worst {tl['norm'].worst:.3g} of "
                                f"the bound (ceil(log2 n)+T+R+4)*2^-24 relative)"
                                + _resolution_text(tl["norm"], "a norm off the recomputed one"), "no norm"))
        if self.view.unsupported:
            out.append(Check.not_applicable("update_matches_optimizer_rule",
                                            f"the optimizer's main params cannot be read: {self.view.unsupported}"))
        else:
            clip = self.last_clip_coeff
            out.append(_verdict("update_matches_optimizer_rule", tl["update"],
                                f"{steps} step(s), {tl['update'].elements} main elements: worst "
                                f"{tl['update'].worst:.3g} of the bound; {self.rule_text}; last "
                                f"clip coefficient {clip:.4g}" + _resolution_text(tl["update"])
                                + (f"; {tl['update'].note}" if tl["update"].note else ""),
                                tl["update"].note or "no main params on this rank"))
        out.append(_verdict("model_params_match_main", tl["model"],
                            f"{tl['model'].elements} model-param elements equal the main params cast to the model "
                            f"dtype after each step",
                            "the model params are the optimizer's main params (fp32 without a distributed "
                            "optimizer): nothing to compare"))
        if self.view.unsupported:
            out.append(Check.not_applicable("all_params_changed", f"main params not readable: "
                                                                  f"{self.view.unsupported}"))
        else:
            out.append(_verdict("all_params_changed", tl["changed"],
                                f"{len(self.names)} trainable params: every one's main param changed in step 0",
                                "no step ran", fail_detail=lambda f: f"unchanged main params: {', '.join(f[:5])}"))
        if self.continuity:
            out.append(_verdict("state_unchanged_between_steps", tl["continuity"],
                                f"main params, optimizer state and model params unchanged between the "
                                f"{steps} steps", "only one step ran"))
        groups = sorted(self.replica_groups)
        out.append(_verdict("replicas_identical", tl["replicas"],
                            f"bit-identical over: {', '.join(groups)}",
                            "no param is replicated over another rank (data-parallel, tensor-parallel duplicate, "
                            "tied embedding) in this configuration"))
        return out


def _verdict(name: str, t: _Tally, detail: str, na: str,
             fail_detail: Callable[[list[str]], str] | None = None) -> Check:
    if not t.applicable:
        return Check.not_applicable(name, na)
    if t.failures:
        text = fail_detail(t.failures) if fail_detail else f"{len(t.failures)} failure(s): " + "; ".join(
            t.failures[:3])
        return Check(name, False, text, {"failures": t.failures, "worst": t.worst})
    return Check(name, True, detail, {"worst": t.worst, "where": t.where, "elements": t.elements})


#: How far the factor the optimizer's gradients carried may be from the reported norm's and loss scale's (in
#: units of itself): the median ratio, rounded to fp32, is within two fp32 roundings of the factor applied
#: (unscaling then clipping), which is within one of the float64 coefficient Megatron computes.
_SCALE_TOLERANCE = 8 * 2.0**-24

#: Elements per main param whose ratio enters the median of :meth:`StepVerifier._scale_check` (strided).
_SCALE_SAMPLES = 4096

#: Main params of at most this many elements share blocks of the rule (biases, norms: one evaluation for all).
_PACK_MAX = 1 << 16

#: Small params per packed block of the gradient comparison (at most this many times :data:`_PACK_MAX` elements).
_PACK_COUNT = 32

#: Elements per block of the float64 rule run op by op (bounds the temporaries: ~14 float64 tensors of this size);
#: compiled into fused kernels on CUDA the blocks are larger (:func:`.fused.block_elements`).
_BLOCK = fused.EAGER_BLOCK


def _per_entry(ids: list[Any], worst_parts: list[Any], over_parts: list[Any], n: int) -> tuple[Any, Any]:
    """Per entry of ``n`` (``ids``: the entry index of each block's values): the largest of its blocks' worst
    ratios and the sum of their counts over the bound, in float64 on the blocks' device (no host sync)."""
    import torch

    dev = worst_parts[0].device
    index = torch.cat(ids).to(dev, non_blocking=True)
    worst = torch.zeros(n, dtype=torch.float64, device=dev).scatter_reduce_(0, index, torch.cat(worst_parts), "amax")
    over = torch.zeros(n, dtype=torch.float64, device=dev).index_add_(0, index, torch.cat(over_parts))
    return worst, over


def _segments(lengths: list[int], device: Any) -> Any:
    """Each element's segment index for segments of ``lengths`` (on ``device``; the output size given, so no host
    sync)."""
    import torch

    counts = torch.tensor(lengths, dtype=torch.int64).to(device, non_blocking=True)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), counts, output_size=sum(lengths))


def _blocks(n: int, size: int = 0) -> list[tuple[int, int]]:
    size = size or _BLOCK
    return [(lo, min(lo + size, n)) for lo in range(0, max(n, 1), size)]


def _differing(mp: MainParam) -> Any:
    """How many elements of ``mp``'s part of its model param differ from the main param cast to the model's
    dtype (a float64 device scalar)."""
    want = mp.main.detach().reshape(-1).to(mp.model.dtype)
    return (mp.model_part(mp.model.detach()) != want).sum().double()


def _on(t: Any, like: Any) -> Any:
    """``t`` on ``like``'s device (a host copy of the snapshot read back; asynchronous from pinned memory)."""
    return t if t.device == like.device else t.to(like.device, non_blocking=True)


def _plain(v: Any) -> Any:
    """A 0-d state entry (Adam's ``step``) as a Python number (a compiled rule reads it without a host sync in
    the kernel's graph)."""
    if _is_tensor(v):
        value = float(v)
        return int(value) if value.is_integer() else value
    return v


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if hasattr(t, "element_size") else 0


def _grad_dtype(param: Any) -> Any:
    main_grad = getattr(param, "main_grad", None)
    return main_grad.dtype if main_grad is not None else param.dtype


def _state_of(mp: MainParam) -> dict[str, Any]:
    return dict(mp.inner.state.get(mp.main, {})) if mp.inner is not None else {}


def _loss_value(d: Any) -> float | None:
    if isinstance(d, dict):
        for v in d.values():
            if hasattr(v, "numel") and v.numel() == 1:
                return float(v.float())
            if isinstance(v, (int, float)):
                return float(v)
        return None
    if hasattr(d, "numel") and d.numel() == 1:
        return float(d.float())
    return None


def _clip_grad(optimizer: Any) -> float:
    for opt in [optimizer, *getattr(optimizer, "chained_optimizers", [])]:
        cfg = getattr(opt, "config", None)
        value = getattr(cfg, "clip_grad", None) if cfg is not None else None
        if value is None:
            value = getattr(opt, "clip_grad", None)
        if value is not None:
            return float(value)
    return 0.0

