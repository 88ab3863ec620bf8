"""``state_unchanged_between_steps``: nothing touched main params, optimizer state or model params between two
steps (their fingerprints, :mod:`..fingerprint`, taken after one step equal those before the next)."""

from __future__ import annotations

from ..._util.own_math import own_tensor_math
from ..report import Check
from .base import VerifierBase
from .tally import verdict


class StateUnchangedBetweenSteps(VerifierBase):
    """The continuity check of :class:`~mcore_compat.selfcheck.verify.StepVerifier`."""

    @own_tensor_math
    def _check_continuity(self) -> None:
        """Before a step: the fingerprints taken after the last one still hold."""
        if not (self.continuity and self._after):
            return
        t = self.tally["continuity"]
        for mp, moved in zip(self.view, self._moved(self._after, model=True), strict=True):
            if moved:
                t.fail(f"step {self.step_index}: {mp.name} changed between steps")
            t.see(0.0, "", mp.main.numel())

    @own_tensor_math
    def _keep_continuity(self) -> None:
        """After a step: fingerprint what the next one must find unchanged."""
        if self.continuity:
            self._after = self._prints(model=True)

    def _continuity_verdict(self) -> Check:
        return verdict("state_unchanged_between_steps", self.tally["continuity"],
                       f"main params, optimizer state and model params unchanged between the {self.step_index} "
                       f"steps", "only one step ran")
