"""``grads_match_reference``: the finalized gradients (the part the optimizer reads) equal a plain-autograd
reference of the same micro-batches at the same weights, reduced by hand (:mod:`..reference`), element by element
within the bound of reordered sums; the losses equal the reference's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..._util.optimizer_view import MainParam
from ..._util.own_math import own_tensor_math
from .. import elements, fused
from ..reference import GradReference
from ..report import Check
from .base import VerifierBase
from .tally import Tally, res_stride, resolution_text, verdict
from .values import PACK_COUNT, PACK_MAX, block_ranges, loss_value, per_entry, segments


class GradsMatchReference(VerifierBase):
    """The gradient comparison of :class:`~mcore_compat.selfcheck.verify.StepVerifier`."""

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
            if 0 < got.numel() <= PACK_MAX:
                small.append(k)
                continue
            want_all, bound_all = self._ref_part(ref, mp)
            for lo, hi in block_ranges(got.numel(), size):
                self._grad_block(t, [(got[lo:hi], want_all, bound_all, lo, hi)], None, 1, worst_parts, over_parts)
                ids.append(torch.tensor([k], dtype=torch.int64))
        # small params packed (biases, norms): one comparison for many, per-param verdicts by segment reductions
        for start in range(0, len(small), PACK_COUNT):
            chunk = small[start:start + PACK_COUNT]
            pieces = []
            for k in chunk:
                mp, got = compared[k]
                want_all, bound_all = self._ref_part(ref, mp)
                pieces.append((got, want_all, bound_all, 0, got.numel()))
            dev = compared[chunk[0]][1].device
            seg = segments([compared[k][1].numel() for k in chunk], dev)
            self._grad_block(t, pieces, seg, len(chunk), worst_parts, over_parts)
            ids.append(torch.tensor(chunk, dtype=torch.int64))
        values = [0.0, 0.0] * len(compared)
        if ids:
            worst_e, over_e = per_entry(ids, worst_parts, over_parts, len(compared))
            values = torch.stack([worst_e, over_e], dim=1).reshape(-1).tolist()  # one host sync
        for k, (mp, got) in enumerate(compared):
            worst, over_total = values[2 * k], values[2 * k + 1]
            t.see(worst, f"{mp.name} step {self.step_index}", got.numel())
            if over_total:
                want_all, bound_all = self._ref_part(ref, mp)
                example = ""
                for lo, hi in block_ranges(got.numel()):
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
    def _grad_block(t: Tally, pieces: list[tuple[Any, Any, Any, int, int]], seg: Any, n: int,
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
        mine = [loss_value(d) for d in losses]
        theirs = [loss_value(d) for d in ref.losses]
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

    def _grads_verdict(self) -> Check:
        t = self.tally["grads"]
        if self.reference is None:
            return Check.not_applicable("grads_match_reference", "no reference copy (reference=False)")
        if self.unreplayable:
            return Check.not_applicable("grads_match_reference", self.unreplayable)
        return verdict("grads_match_reference", t,
                       f"{self.step_index} step(s): finalized gradients vs a plain-autograd reference, worst "
                       f"{t.worst:.3g} of the bound 2(k-1)u*sum|terms| ({t.where or 'every element equal'})"
                       + resolution_text(t, "a gradient off the reference"), "no gradient on this rank")
