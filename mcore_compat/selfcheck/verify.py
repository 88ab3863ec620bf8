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
gradient comparison and the rule run in blocks of :data:`._checks.values.BLOCK` elements (params of at most
:data:`._checks.values.PACK_MAX` elements packed together into one evaluation of the rule, their verdicts by
segment reductions), each check's verdicts read with one host sync.

Checks that cannot apply say so (e.g. ``model_params_match_main`` when the model params are the main params).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .._util.optimizer_view import optimizer_view
from .._util.own_math import own_tensor_math
from ..errors import McoreCompatError
from . import fused
from ._checks.all_params_changed import AllParamsChanged
from ._checks.grad_norm_matches_reference import GradNormMatchesReference
from ._checks.grads_match_reference import GradsMatchReference
from ._checks.model_params_match_main import ModelParamsMatchMain
from ._checks.optimizer_covers_params import OptimizerCoversParams
from ._checks.replicas_identical import ReplicasIdentical
from ._checks.state_unchanged_between_steps import StateUnchangedBetweenSteps
from ._checks.tally import Tally
from ._checks.update_matches_optimizer_rule import UpdateMatchesOptimizerRule
from ._checks.values import Pre, clone_state, grad_dtype, state_of, tensor_bytes
from .configured import Configured, from_optimizer
from .fingerprint import Fingerprint, fingerprints
from .groups import Groups
from .host_snapshot import HostSnapshot
from .in_step import InStep, not_streamable
from .invariants import global_grad_norm
from .oracle import _is_tensor, rule_of
from .reference import PlainReference
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


class StepVerifier(OptimizerCoversParams, GradsMatchReference, GradNormMatchesReference, UpdateMatchesOptimizerRule,
                   ModelParamsMatchMain, AllParamsChanged, StateUnchangedBetweenSteps, ReplicasIdentical):
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
        self.rules = {id(i): rule_of(i) for i in self.view.inner}
        self.configured = {0: configured} if configured is not None else \
            from_optimizer(optimizer)
        # which main params' groups decay at the start (the build-time param-group rule, before any step)
        self._decays = {
            id(mp): mp.group is not None and float(mp.group.get("wd_mult", 1.0)) != 0.0
            and float(mp.group.get("weight_decay", 0.0)) != 0.0 for mp in self.view}
        self._eps_built = {
            id(mp): float(mp.group["eps"]) if mp.group is not None and "eps" in mp.group else None for mp in self.view}
        self.continuity = continuity
        self.step_index = 0
        self.tally = {k: Tally() for k in (
            "grads", "norm", "update", "model", "changed", "continuity", "replicas", "loss")}
        self._pre = {}
        self._host: HostSnapshot | None = None
        #: elements of each main param (by id) the step changed, counted by the update check
        self._changed = {}
        self._after = {}
        self._entry = {}
        self._loss_scale = 1.0
        self.losses_seen = []
        self.replica_groups = set()
        self.last_clip_coeff = 1.0
        self.rule_text = ""
        self.unchanged = []
        self.reference = None
        self.reference_bytes = 0
        #: bytes of the last pre-step snapshot on the params' device and (:data:`HOST_SNAPSHOT`) in host memory
        self.snapshot_bytes = 0
        self.snapshot_host_bytes = 0
        self.rng = RngReplay(self.chunks)
        self.routing = RoutingReplay(self.chunks)
        #: why the reference cannot draw the step's dropout masks (then no gradient comparison), or ``None``
        self.unreplayable = unreplayable_reason(self.chunks) if reference else None
        if reference:
            self.reference = PlainReference(self.chunks, self.groups, grad_dtype, per_token_loss=per_token_loss,
                                            share_weights=one_step)
            self.reference_bytes = self.reference.nbytes()
        self._setup_checks = self._coverage()
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
        self._of_main = {id(mp.main): mp for mp in self.view}
        self._grad_prints = {}
        self._copied_grads = set()
        #: per inner optimizer (streamed): the factor its gradients carried (a 0-d device tensor)
        self._scales = {}
        self._verified = {}
        self._norm_mine = None
        self._stepping = False

    @property
    def loss_scale_now(self) -> float:
        """The loss scale of the step being checked (the finalized gradients carry it until the optimizer
        unscales them)."""
        return self._loss_scale

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
        self._check_continuity()
        self._pre = {}
        for mp in self.view:
            self._pre[id(mp)] = Pre(None, {}, None if mp.group is None else {k: mp.group[k] for k in _HYPER_KEYS
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
            state = state_of(mp)
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
            need += mp.main.numel() * 4 + tensor_bytes(mp.finalized_grad())
            need += sum(tensor_bytes(v) for v in state_of(mp).values() if _is_tensor(v) and v.dim())
        free = torch.cuda.mem_get_info(self.device)[0]
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        headroom = fused.FUSED_BLOCK * 8 * 4  # the update check's block-sized outputs and inputs
        return () if need + headroom <= 0.9 * (free + cached) else HOST_WHEN_SHORT

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
            pre.state0 = clone_state(state_of(mp), mine)
            g = mp.finalized_grad()
            pre.grad = None if g is None else g.detach().clone()
            for v in (pre.p0, pre.grad, *pre.state0.values()):
                if _is_tensor(v) and v.device != self.device:
                    self.snapshot_host_bytes += tensor_bytes(v)
                else:
                    self.snapshot_bytes += tensor_bytes(v)
        self._grads_unchanged(list(self.view), grad_prints, "while the reference ran")

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
                self.snapshot_bytes += tensor_bytes(pre.grad)
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
        self._keep_continuity()
        self.step_index += 1

    @own_tensor_math
    def final_replicas(self) -> None:
        """Check the replicas once more (call when the last step's params are in place on every rank)."""
        self._replicas(f"after step {self.step_index - 1}")

    # ------------------------------------------------------------------------------------------- verdicts
    @own_tensor_math
    def checks(self) -> list[Check]:
        """The verdicts of this rank (merge over ranks with :func:`~.report.merge_rank_checks`), one per check
        (each check's logic and verdict: its module in :mod:`mcore_compat.selfcheck._checks`)."""
        out = [*self._setup_checks, self._grads_verdict(), self._norm_verdict(), self._update_verdict(),
               self._model_verdict(), self._changed_verdict()]
        if self.continuity:
            out.append(self._continuity_verdict())
        out.append(self._replicas_verdict())
        return out
