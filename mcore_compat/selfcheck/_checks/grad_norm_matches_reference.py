"""``grad_norm_matches_reference``: the norm the optimizer reports equals the norm of the finalized gradients
recomputed here (tensor-parallel shards once, replicated params once, the tied copy once), within the bound of
its sums."""

from __future__ import annotations

from ..report import Check
from .base import VerifierBase
from .tally import resolution_text, verdict
from .values import clip_grad


class GradNormMatchesReference(VerifierBase):
    """The norm check of :class:`~mcore_compat.selfcheck.verify.StepVerifier`."""

    def _check_norm(self, grad_norm: float | None) -> None:
        t = self.tally["norm"]
        if self.view.unsupported or self._norm_mine is None:
            return
        mine, bound = self._norm_mine
        if grad_norm is None or (grad_norm == 0.0 and not clip_grad(self.optimizer)):
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

    def _norm_verdict(self) -> Check:
        t = self.tally["norm"]
        if self.view.unsupported or (not t.applicable and t.note):
            return Check.not_applicable("grad_norm_matches_reference",
                                        t.note or f"optimizer not readable: {self.view.unsupported}")
        return verdict("grad_norm_matches_reference", t,
                       f"reported vs recomputed norm {t.note} (worst {t.worst:.3g} of the bound "
                       f"(ceil(log2 n)+T+R+4)*2^-24 relative)" + resolution_text(t, "a norm off the recomputed one"),
                       "no norm")
