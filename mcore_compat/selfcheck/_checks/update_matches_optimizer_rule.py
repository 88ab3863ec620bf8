"""``update_matches_optimizer_rule``: every main param and its moments after the step equal the optimizer's rule
(:mod:`..oracle`, float64) applied to its value and state before the step, the finalized gradient (unscaled,
clipped by the reported norm) and the hyper-parameters its configuration gives it (:mod:`..configured`), within
the fp32 rounding bound; elements a step cannot change must not change. Streamed (:mod:`..in_step`): checked
inside the optimizer's step part by part, the factor its gradients carry fitted and compared with the reported
norm's."""

from __future__ import annotations

from typing import Any

from ..._util.optimizer_view import MainParam
from ..._util.own_math import own_tensor_math
from .. import elements, fused
from ..configured import Configured
from ..oracle import BOUND_TEXT, Rule, _is_tensor, branches, expected_step, rule_of
from ..report import Check
from .base import VerifierBase
from .tally import Tally, res_stride, resolution_text, verdict
from .values import (
    Pre,
    block_ranges,
    clip_grad,
    clone_state,
    on_device,
    pack,
    per_entry,
    plain,
    segments,
    state_of,
    tensor_bytes,
)

#: How far the factor the optimizer's gradients carried may be from the reported norm's and loss scale's (in
#: units of itself): the median ratio, rounded to fp32, is within two fp32 roundings of the factor applied
#: (unscaling then clipping), which is within one of the float64 coefficient Megatron computes.
_SCALE_TOLERANCE = 8 * 2.0**-24


#: Elements per main param whose ratio enters the median of
#: :meth:`UpdateMatchesOptimizerRule._scale_check` (strided).
_SCALE_SAMPLES = 4096


class UpdateMatchesOptimizerRule(VerifierBase):
    """The update check of :class:`~mcore_compat.selfcheck.verify.StepVerifier`."""

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
    def _part_snapshot(self, inner: Any, part: list[Any]) -> dict[int, Pre]:
        """The pre-update values of one part of ``inner``'s params (streamed): main param and state (the
        finalized gradient is kept for the whole step)."""
        pres: dict[int, Pre] = {}
        nbytes = 0
        for p in part:
            mp = self._of_main.get(id(p))
            if mp is None or mp.inner is not inner:
                continue
            pre = Pre(mp.main.detach().float().clone(), clone_state(state_of(mp)), self._pre[id(mp)].group,
                       self._pre[id(mp)].grad)
            pres[id(mp)] = pre
            nbytes += sum(tensor_bytes(v) for v in (pre.p0, *pre.state0.values()) if _is_tensor(v))
        self.snapshot_bytes = max(self.snapshot_bytes, sum(tensor_bytes(self._pre[k].grad) for k in self._copied_grads)
                                  + nbytes)
        return pres

    @own_tensor_math
    def _verify_part(self, inner: Any, part: list[Any], pres: dict[int, Pre]) -> None:
        """One part's update against the rule (the finalized gradient times the factor the optimizer's
        gradients carry, :meth:`_scale_check`), then its fingerprints, proven unchanged in :meth:`after_step`."""
        mps = [self._of_main[id(p)] for p in part if id(p) in self._of_main and id(self._of_main[id(p)]) in pres]
        self._verify_update(mps, pres, self._scales.get(id(inner), 1.0), True)
        self._verified.update(self._prints(mps=mps))

    def _clip_coeff(self, grad_norm: float | None) -> float:
        clip = clip_grad(self.optimizer)
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
                           f"{clip_grad(self.optimizer):g}, loss scale {self._loss_scale:g})")
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

    def _verify_update(self, mps: list[MainParam], pres: dict[int, Pre], scale: Any,
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
                if not torch.equal(after.float(), on_device(pre.p0, after).reshape(-1)):
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
                if not torch.equal(after.float(), on_device(pre.p0, after).reshape(-1)):
                    t.fail(f"step {self.step_index}: the step was skipped (overflow) but {mp.name} changed")
                continue
            if pre.grad is None:
                t.fail(f"step {self.step_index}: {mp.name} had no gradient to update with")
                continue
            now = state_of(mp)
            step = int(float(pre.state0["step"])) if "step" in pre.state0 else None
            tensors = tuple(sorted(k for k, v in pre.state0.items() if _is_tensor(v) and v.dim()))
            # the moments the rule gives (:func:`.oracle.expected_step`)
            moments = ["exp_avg", "exp_avg_sq"] if rule.kind == "adam" else (
                ["momentum_buffer"] if hyper.get("momentum") else [])
            missing = {k for k in moments if k not in now}
            pack_key = (rule, tuple(sorted(hyper.items())), step, tensors, tuple(sorted(missing)), after.device)
            packs.setdefault(pack_key, []).append(len(entries))
            entries.append((mp, pre, rule, hyper, now, missing, [k for k in moments if k not in missing], step))
        # every main param's elements in blocks of <= BLOCK elements; small params packed into one block (one
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
                                               "step": plain(first[1].state0.get("step"))}, first[0].main.device)
            for block in pack(entries, members, size):
                self._update_block(t, entries, block, scalars, ids, worst_parts, over_parts, moment_parts)
        if not ids:
            return
        n = len(entries)
        worst_e, over_e = per_entry(ids, worst_parts, over_parts, n)
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

    def _update_block(self, t: Tally, entries: list[tuple[Any, ...]], block: list[tuple[int, int, int]],
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
        p0 = on_device(cat([entries[e][1].p0.reshape(-1)[lo:hi] for e, lo, hi in block]), got)
        grad = cat([entries[e][1].grad.reshape(-1)[lo:hi] for e, lo, hi in block])
        state0 = {k: (on_device(cat([entries[e][1].state0[k].reshape(-1)[lo:hi] for e, lo, hi in block]), got)
                      if _is_tensor(v) and v.dim() else plain(v)) for k, v in pre0.state0.items()}
        now = {key: cat([entries[e][4][key].detach().reshape(-1)[lo:hi] for e, lo, hi in block]) for key in moments}
        seg = None
        if len(block) > 1:
            seg = segments([hi - lo for _e, lo, hi in block], p0.device)
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

    def _expected_block(self, mp: MainParam, pre: Pre, rule: Rule, hyper: dict[str, Any], scale: Any, lo: int,
                        hi: int) -> tuple[Any, dict[str, Any], Any, Any]:
        """The rule on elements ``lo:hi`` of ``mp``: ``(p', state', bound, the main param seen)`` (float64)."""
        p0 = on_device(pre.p0.reshape(-1)[lo:hi], pre.grad)
        grad = pre.grad.reshape(-1)[lo:hi].double() * scale
        state0 = {k: (on_device(v.reshape(-1)[lo:hi], pre.grad) if _is_tensor(v) and v.dim() else v)
                  for k, v in pre.state0.items()}
        p1, state1, bound = expected_step(rule, hyper, p0, grad, state0)
        return p1, state1, bound, mp.main.detach().reshape(-1)[lo:hi].double()

    def _update_example(self, mp: MainParam, pre: Pre, rule: Rule, hyper: dict[str, Any], scale: Any) -> str:
        """The first element of ``mp`` off the rule, in words (the failure path: the blocks recomputed)."""
        import torch

        for lo, hi in block_ranges(mp.main.numel()):
            p1, _state1, bound, got = self._expected_block(mp, pre, rule, hyper, scale, lo, hi)
            err = (got - p1).abs()
            if bool((err > bound).any()):
                i = int(torch.argmax(err - bound))
                return (f"e.g. {float(got[i]):.9g} vs {float(p1[i]):.9g} from {float(pre.p0.reshape(-1)[lo + i]):.9g}"
                        f", bound {float(bound[i]):.3g}")
        return ""

    def _update_verdict(self) -> Check:
        t = self.tally["update"]
        if self.view.unsupported:
            return Check.not_applicable("update_matches_optimizer_rule",
                                        f"the optimizer's main params cannot be read: {self.view.unsupported}")
        return verdict("update_matches_optimizer_rule", t,
                       f"{self.step_index} step(s), {t.elements} main elements: worst {t.worst:.3g} of the bound; "
                       f"{self.rule_text}; last clip coefficient {self.last_clip_coeff:.4g}" + resolution_text(t)
                       + (f"; {t.note}" if t.note else ""), t.note or "no main params on this rank")
