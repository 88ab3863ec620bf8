"""``optimizer_covers_params``: every trainable element is updated by exactly one main param of some param group
(shards summed over the ranks that hold them), and the main params start equal to the model's."""

from __future__ import annotations

from ..._util.own_math import own_tensor_math
from ...launch import gather_objects
from ..report import Check
from .base import VerifierBase
from .values import differing, read_scalars


class OptimizerCoversParams(VerifierBase):
    """The set-up check of :class:`~mcore_compat.selfcheck.verify.StepVerifier`."""

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
        differs = read_scalars([differing(mp) for mp in compared])  # one host sync
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
