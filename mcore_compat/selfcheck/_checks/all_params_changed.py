"""``all_params_changed``: every trainable param's main param (the optimizer's fp32 copy or shard, merged over the
ranks that share it) changed in the first step."""

from __future__ import annotations

from typing import Any

from ...launch import gather_objects
from ..report import Check
from .base import VerifierBase
from .tally import verdict
from .values import on_device, read_scalars


class AllParamsChanged(VerifierBase):
    """The first step's change check of :class:`~mcore_compat.selfcheck.verify.StepVerifier`."""

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
                n = (after != on_device(pre.p0, after).reshape(-1)).sum()
            per_mp.append(n.reshape(()).double())
        counts: dict[str, int] = {}
        for mp, n in zip(self.view, read_scalars(per_mp), strict=True):  # one host sync
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

    def _changed_verdict(self) -> Check:
        if self.view.unsupported:
            return Check.not_applicable("all_params_changed", f"main params not readable: {self.view.unsupported}")
        return verdict("all_params_changed", self.tally["changed"],
                       f"{len(self.names)} trainable params: every one's main param changed in step 0",
                       "no step ran", fail_detail=lambda f: f"unchanged main params: {', '.join(f[:5])}")
