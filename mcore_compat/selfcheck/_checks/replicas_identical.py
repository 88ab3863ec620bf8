"""``replicas_identical``: every param replicated over a group is bit-identical over it (data parallel, expert
data parallel, tensor-parallel duplicates, the tied embedding/output pair), after each forward and at the end."""

from __future__ import annotations

from ..._util.own_math import own_tensor_math
from ..invariants import compare_replicas
from ..report import Check
from .base import VerifierBase
from .tally import verdict


class ReplicasIdentical(VerifierBase):
    """The replica check of :class:`~mcore_compat.selfcheck.verify.StepVerifier`."""

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

    def _replicas_verdict(self) -> Check:
        return verdict("replicas_identical", self.tally["replicas"],
                       f"bit-identical over: {', '.join(sorted(self.replica_groups))}",
                       "no param is replicated over another rank (data-parallel, tensor-parallel duplicate, tied "
                       "embedding) in this configuration")
