"""What the checks of a step share: the verifier's state (declared here, set by
:class:`~mcore_compat.selfcheck.verify.StepVerifier`) and the fingerprints that prove values unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..._util.optimizer_view import MainParam, OptimizerView
from ..._util.own_math import own_tensor_math
from ..configured import Configured
from ..fingerprint import Fingerprint, changed, fingerprints
from ..groups import Groups
from ..in_step import InStep
from ..oracle import Rule
from ..reference import PlainReference
from ..report import Check
from .tally import Tally
from .values import Pre, state_of


class VerifierBase:
    """The state every check reads (see :class:`~mcore_compat.selfcheck.verify.StepVerifier` for each)."""

    chunks: list[Any]
    optimizer: Any
    device: Any
    groups: Groups
    names: dict[Any, str]
    view: OptimizerView
    rules: dict[int, Rule | str]
    configured: dict[int, Configured | str]
    _decays: dict[int, bool]
    _eps_built: dict[int, float | None]
    continuity: bool
    step_index: int
    tally: dict[str, Tally]
    _pre: dict[int, Pre]
    _changed: dict[int, Any]
    _after: dict[int, list[Fingerprint]]
    _entry: dict[int, list[Fingerprint]]
    _loss_scale: float
    losses_seen: list[float]
    replica_groups: set[str]
    last_clip_coeff: float
    rule_text: str
    unchanged: list[str]
    reference: PlainReference | None
    snapshot_bytes: int
    snapshot_host_bytes: int
    unreplayable: str | None
    _setup_checks: list[Check]
    stream: bool
    _in_step: InStep
    _of_main: dict[int, MainParam]
    _grad_prints: dict[int, Fingerprint]
    _copied_grads: set[int]
    _scales: dict[int, Any]
    _verified: dict[int, list[Fingerprint]]
    _norm_mine: tuple[float, float] | None

    @own_tensor_math
    def _prints(self, model: bool = False, mps: Sequence[MainParam] | None = None) -> dict[int, list[Fingerprint]]:
        """Per main param (of ``mps``, default all): fingerprints of its main param and optimizer state (and, with
        ``model``, its model param), all taken together (:func:`.fingerprint.fingerprints`)."""
        items: list[Any] = []
        spans: list[tuple[int, int, int]] = []
        for mp in (self.view if mps is None else mps):
            state = state_of(mp)
            mine: list[Any] = [tuple(sorted(state))] + [state[k] for k in sorted(state)]
            if not (model and mp.main is mp.model):
                mine.append(mp.main)
            if model:
                mine.append(mp.model_part(mp.model.detach()))
            spans.append((id(mp), len(items), len(items) + len(mine)))
            items.extend(mine)
        prints = fingerprints(items)
        return {k: prints[lo:hi] for k, lo, hi in spans}

    @own_tensor_math
    def _moved(self, before: dict[int, list[Fingerprint]], model: bool = False,
               mps: Sequence[MainParam] | None = None) -> list[bool]:
        """Per main param (of ``mps``, default all, in order): do its fingerprints now differ from ``before``'s?"""
        mps = list(self.view) if mps is None else list(mps)
        now_all = self._prints(model, mps)
        pairs: list[tuple[Fingerprint, Fingerprint]] = []
        spans: list[tuple[int, int, bool]] = []
        for mp in mps:
            now, then = now_all[id(mp)], before[id(mp)]
            spans.append((len(pairs), len(pairs) + min(len(now), len(then)), len(now) != len(then)))
            pairs.extend(zip(then, now, strict=False))
        diff = changed(pairs)
        return [odd or any(diff[lo:hi]) for lo, hi, odd in spans]

    def _grads_unchanged(self, mps: list[MainParam], grad_prints: dict[int, Fingerprint], when: str) -> None:
        """The kept finalized gradients (``_pre[...].grad``) of those of ``mps`` fingerprinted in
        ``grad_prints`` still have those fingerprints; a ``grads_match_reference`` failure for each that changed
        (``when``: since when, in words)."""
        kept = [mp for mp in mps if id(mp) in grad_prints]
        pairs = list(zip([grad_prints[id(mp)] for mp in kept], fingerprints([self._pre[id(mp)].grad for mp in kept]),
                         strict=True))
        for mp, moved in zip(kept, changed(pairs), strict=True):
            if moved:
                self.tally["grads"].fail(f"step {self.step_index}: {mp.name}: the finalized gradient changed {when}")
