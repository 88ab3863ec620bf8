"""The pieces of :mod:`.directional`'s verdict: one evaluation along a direction (:class:`Eval`), a parameter block
(:class:`Block`), the seeds of the directions, the bisection of a failing direction down to parameters, and
``loss_matches_float64``'s comparison."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from .report import Check


# ------------------------------------------------------------------------------------------------ the check
class Eval(NamedTuple):
    """One direction restricted to a set of blocks (every rank the same: global sums): ``<g, v>`` of the model's
    finalized gradient, ``<g64, v>`` of the float64 copy's, ``D(h)`` (``nan`` where not evaluated), the bound of
    ``|<g64, v> - D|`` (its finite-difference part and the float64 rounding of ``g64``), the bound of
    ``|<g, v> - <g64, v>|`` (the model dtype's gradient error) and ``|g|`` of the set."""

    gv: float
    g64v: float
    d: float
    fd_bound: float
    bound64: float
    dtype_bound: float
    gnorm: float

    def backward_fails(self) -> bool:
        """The float64 copy's gradient disagrees with its own forward (the backward code)."""
        return not math.isnan(self.d) and abs(self.g64v - self.d) > self.bound64

    def dtype_fails(self) -> bool:
        """The model's gradient disagrees with the float64 copy's beyond the model dtype's error."""
        return abs(self.gv - self.g64v) > self.dtype_bound

    def fails(self) -> bool:
        return self.backward_fails() or self.dtype_fails()

    def why(self) -> str:
        parts = []
        if self.backward_fails():
            if abs(self.d) <= self.fd_bound:
                parts.append(f"the forward does not read it: directional derivative 0 within {self.fd_bound:.2g}, "
                             f"the backward's <g64, v> {self.g64v:.4g}")
            else:
                parts.append(f"the backward's <g64, v> {self.g64v:.4g} vs the forward's D {self.d:.4g}, bound "
                             f"{self.bound64:.2g}")
        if self.dtype_fails():
            parts.append(f"the step's <g, v> {self.gv:.4g} vs the float64 copy's {self.g64v:.4g}, bound "
                         f"{self.dtype_bound:.2g}")
        return "; ".join(parts)


@dataclass
class Block:
    """One parameter block: its model param, the main params standing for it and its weights in the sums."""

    name: str
    param: Any
    copy: Any
    seed_key: int
    weight: float  # the factor of this rank's sums of the whole param: 1 / (ranks holding the same values)
    shard: int  # the ranks the distributed optimizer shards its main params over ((expert-)DP)
    parts: list[Any]  # MainParams of this param on this rank
    index: int = -1  # its place in the list of every rank's blocks (:attr:`FiniteDifferences.names_all`)


def seed(*parts: int) -> int:
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (p & 0xFFFFFFFFFFFF)) * 1099511628211) & 0x7FFFFFFFFFFFFFFF
    return h


def stable(name: str) -> int:
    import zlib

    return zlib.crc32(name.encode())


def bisect(names: Sequence[str], evaluate: Callable[[list[int], int], Eval], subset: list[int], k: int,
           top: Eval, derive: Callable[[list[int], int, Eval, Eval], Eval] | None, budget_nodes: int) -> list[str]:
    """The blocks of ``subset`` whose gradient disagrees with the forward along direction ``k`` (``top``: the
    evaluation of the whole ``subset``): each node's first half evaluated, its second derived from the node and
    the first half (``derive``, no forward; where ``derive`` is None, evaluated too), the failing ones bisected
    further, at most ``budget_nodes`` evaluations (every rank makes the same choices: the sums are
    global)."""
    out: list[str] = []
    budget = [budget_nodes]

    def visit(part: list[int], here: Eval) -> None:
        mid = len(part) // 2
        halves = (part[:mid], part[mid:])
        results: list[Eval | None] = []
        for half in halves:
            first = results[0] if results else None
            if derive is not None and first is not None:
                results.append(derive(half, k, here, first))
                continue
            if derive is not None and budget[0] <= 0:  # part 2's comparisons cost no forward: no budget
                name = names[half[0]]
                out.append(f"{name} (not evaluated: bisection budget spent)" if len(half) == 1 else
                           f"{len(half)} params from {name} (not bisected: budget spent)")
                results.append(None)
                continue
            budget[0] -= 1
            results.append(evaluate(half, k))
        bad = [(half, r) for half, r in zip(halves, results, strict=True) if r is not None and r.fails()]
        if not bad and all(r is not None for r in results):  # neither half alone exceeds its bound: the set
            out.append(f"{len(part)} params from {names[part[0]]} to {names[part[-1]]}")
        for half, r in bad:
            if len(half) == 1:
                out.append(f"{names[half[0]]} ({r.why()})")
            else:
                visit(half, r)

    if len(subset) == 1:
        out.append(f"{names[subset[0]]} ({top.why()})")
    else:
        visit(subset, top)
    return out


def loss_check(name: str, got64: list[float], model: list[float | None], dtype: str, rho: float) -> Check:
    """``loss_matches_float64`` (``name``): each micro-batch's loss of the step (``model``) against the float64
    copy's (``got64``) within ``rho`` relative."""
    if not got64:
        return Check.not_applicable(name, "no loss on this rank (not the last pipeline stage)")
    worst, failures = 0.0, []
    for i, (a, b) in enumerate(zip(model, got64, strict=False)):
        if a is None:
            continue
        ratio = abs(a - b) / (rho * max(abs(b), 1e-30))
        worst = max(worst, ratio)
        if ratio > 1:
            failures.append(f"micro-batch {i}: loss {a:.8g} vs the float64 copy's {b:.8g} at the current params")
    if not failures:
        return Check(name, True, f"{len(got64)} micro-batch losses of the step vs the float64 copy's at the "
                                  f"current params: worst {worst:.3g} of {rho:g} relative ({dtype})",
                     {"worst": worst})
    return Check(name, False, "; ".join(failures[:3]) + " (the forward computed with other values than the "
                                                         "current params?)", {"worst": worst})
