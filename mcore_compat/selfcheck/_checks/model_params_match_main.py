"""``model_params_match_main``: after each step the model params equal the main params cast to the model dtype,
bit for bit (N/A where the model params are the main params)."""

from __future__ import annotations

from ..report import Check
from .base import VerifierBase
from .tally import verdict
from .values import differing, read_scalars


class ModelParamsMatchMain(VerifierBase):
    """The model-param check of :class:`~mcore_compat.selfcheck.verify.StepVerifier`."""

    def _check_model_params(self) -> None:
        t = self.tally["model"]
        compared = [mp for mp in self.view if mp.main is not mp.model]
        for mp, n in zip(compared, read_scalars([differing(mp) for mp in compared]), strict=True):  # one host sync
            t.see(0.0, mp.name, mp.main.numel())
            if n:
                t.fail(f"step {self.step_index}: {mp.name}: {int(n)}/{mp.main.numel()} elements differ from the main "
                       f"params cast to {str(mp.model.dtype).replace('torch.', '')}")

    def _model_verdict(self) -> Check:
        t = self.tally["model"]
        return verdict("model_params_match_main", t,
                       f"{t.elements} model-param elements equal the main params cast to the model dtype after each "
                       f"step",
                       "the model params are the optimizer's main params (fp32 without a distributed optimizer): "
                       "nothing to compare")
