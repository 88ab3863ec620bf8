"""One check's findings over the steps (:class:`Tally`) and its verdict: the worst element, the failures, and the
resolution (how small a deviation each element could have shown)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..report import Check

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


def nonzero(counts: Any) -> list[int]:
    """Indices of the nonzero entries of a 1-d CPU tensor."""
    return [int(i) for i in counts.nonzero().reshape(-1).tolist()]


@dataclass
class Tally:
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
        for i in nonzero(counts):
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


def resolution_text(tally: Tally, what: str = "a main param off the rule") -> str:
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


def verdict(name: str, t: Tally, detail: str, na: str,
             fail_detail: Callable[[list[str]], str] | None = None) -> Check:
    if not t.applicable:
        return Check.not_applicable(name, na)
    if t.failures:
        text = fail_detail(t.failures) if fail_detail else f"{len(t.failures)} failure(s): " + "; ".join(
            t.failures[:3])
        return Check(name, False, text, {"failures": t.failures, "worst": t.worst})
    return Check(name, True, detail, {"worst": t.worst, "where": t.where, "elements": t.elements})
