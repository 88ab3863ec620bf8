"""The update check run inside the optimizer's step, part by part: no copy of the whole optimizer state.

The update check compares every main param and moment after the step with the rule applied to their values
before it; kept whole, those values cost 12 bytes per element (fp32 main param and two moments: 6 bytes per byte
of a bf16 model). Where the inner optimizer's rule acts on each element alone (torch's, apex's and
TransformerEngine's Adam and SGD: :data:`ELEMENTWISE`), :class:`InStep` replaces its ``step`` for one call of
Megatron's optimizer step and runs it in :data:`PARTS` parts: before each part's update it copies that part's
values (about 1/:data:`PARTS` of the whole), runs the real ``step`` with the other params' gradients hidden
(``grad = None``: every such optimizer skips a param without a gradient), then lets the verifier compare the part
and fingerprint what it verified, so that a change later in the step (the rest of Megatron's step, another
part's update) is caught too. Per element the arithmetic is that of one whole call; the param group's entries the
step itself updates (apex's and TransformerEngine's per-group step count) are reset to their values at the start
of the call before each further part, so every part sees what one call would.

What the verifier proves at the start of the call (:meth:`~.verify.StepVerifier.entering_step`): the main params
and state equal those fingerprinted before the forward, the finalized gradients equal those compared with the
reference, and the gradients the optimizer reads are those times one common factor (Megatron's unscaling and
clipping), which must equal the factor the reported norm and loss scale give (checked after the step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["ELEMENTWISE", "PARTS", "InStep", "not_streamable"]

#: parts of one optimizer step: the copy of a part's pre-step values costs 12/PARTS bytes per main element; on an
#: H200, 4 parts cost 4.1 plain steps per check of the 0.94 B GPT where 8 parts cost 4.7 (one run after the other;
#: both 3.0x the param bytes of peak memory above a plain step, the peak being the reference's)
PARTS = 4

#: inner optimizers whose update of each element reads only that element's value, gradient and state
#: (``module prefix``, class name); another optimizer is checked from a whole snapshot instead
ELEMENTWISE = frozenset({
    ("torch.optim", "Adam"), ("torch.optim", "AdamW"), ("torch.optim", "SGD"),
    ("apex.optimizers", "FusedAdam"), ("apex.optimizers", "FusedSGD"),
    ("transformer_engine.pytorch.optimizers", "FusedAdam"), ("transformer_engine.pytorch.optimizers", "FusedSGD"),
})


def _elementwise(cls: type) -> bool:
    """One of :data:`ELEMENTWISE`, or a subclass of torch's Adam, AdamW or SGD that keeps its ``step`` (such as
    the apex ``FusedAdam`` stand-in of ``mcore_compat.patches`` on CPU)."""
    if any(cls.__module__.startswith(mod) and cls.__name__ == name for mod, name in ELEMENTWISE):
        return True
    import inspect

    import torch

    return any(issubclass(cls, base) and inspect.unwrap(cls.step) is inspect.unwrap(base.step)
               for base in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD))


def not_streamable(inner: Any, optimizer: Any) -> str | None:
    """Why ``inner``'s step cannot be checked part by part, or ``None``."""
    cls = type(inner)
    if not _elementwise(cls):
        return f"{cls.__module__}.{cls.__name__} is not known to update each element on its own"
    for opt in [optimizer, *getattr(optimizer, "chained_optimizers", [])]:
        if getattr(getattr(opt, "config", None), "use_precision_aware_optimizer", False):
            return "the precision-aware optimizer reads decoupled gradients"
    return None


def partition(params: list[Any], parts: int | None = None) -> list[list[Any]]:
    """``params`` in order, cut into about ``parts`` (default :data:`PARTS`, read at the call) runs of similar
    element counts (a param is never split)."""
    parts = PARTS if parts is None else parts
    total = sum(p.numel() for p in params)
    size = max(1, -(-total // max(parts, 1)))
    out: list[list[Any]] = [[]]
    count = 0
    for p in params:
        if count >= size and out[-1]:
            out.append([])
            count = 0
        out[-1].append(p)
        count += p.numel()
    return out


class InStep:
    """Replaces the inner optimizers' ``step`` while :meth:`installed` is active.

    Args:
        before: called once per inner optimizer at the start of its step, with it.
        snapshot: ``snapshot(inner, part params)`` copies what the part's check needs; returns it.
        verify: ``verify(inner, part params, snapshot)`` after the part's update.
    """

    def __init__(self, before: Callable[[Any], None], snapshot: Callable[[Any, list[Any]], Any],
                 verify: Callable[[Any, list[Any], Any], None]) -> None:
        self.before, self.snapshot, self.verify = before, snapshot, verify
        #: the inner optimizers whose step ran (part by part) under :meth:`installed`
        self.ran: set[int] = set()

    @contextmanager
    def installed(self, inners: list[Any]) -> Iterator[None]:
        """Within: each of ``inners`` steps part by part (once; a second call in the same step runs whole)."""
        saved: list[tuple[Any, bool, Any]] = []
        self.ran = set()
        try:
            for inner in inners:
                own = "step" in vars(inner)
                saved.append((inner, own, vars(inner).get("step")))
                inner.step = self._wrap(inner, inner.step)
            yield
        finally:
            for inner, own, value in reversed(saved):
                if own:
                    inner.step = value
                else:
                    del inner.step

    def _wrap(self, inner: Any, real: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            if id(inner) in self.ran:
                return real(*args, **kwargs)
            self.ran.add(id(inner))
            self.before(inner)
            return self._in_parts(inner, real, args, kwargs)

        return step

    def _in_parts(self, inner: Any, real: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        params = [p for g in inner.param_groups for p in g["params"]]
        grads = {id(p): p.grad for p in params}
        start = [(g, _entries(g)) for g in inner.param_groups]
        out = None
        try:
            for k, part in enumerate(partition(params)):
                if k:
                    for g, entries in start:
                        _reset(g, entries)
                taken = self.snapshot(inner, part)
                mine = {id(p) for p in part}
                for p in params:
                    p.grad = grads[id(p)] if id(p) in mine else None
                out = real(*args, **kwargs)
                for p in params:
                    p.grad = grads[id(p)]
                self.verify(inner, part, taken)
                del taken
        finally:
            for p in params:
                p.grad = grads[id(p)]
        return out


def _entries(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's entries other than its params, tensors copied."""
    return {k: (v.detach().clone() if hasattr(v, "detach") else v) for k, v in group.items() if k != "params"}


def _reset(group: dict[str, Any], entries: dict[str, Any]) -> None:
    """The group's entries back to ``entries`` (those the step changed; tensors in place; those it added gone)."""
    for k in [k for k in group if k != "params" and k not in entries]:
        del group[k]
    for k, v in entries.items():
        now: Any = group.get(k)
        if hasattr(v, "detach"):
            if hasattr(now, "copy_") and now.shape == v.shape:
                now.copy_(v)
            else:
                group[k] = v.clone()
        elif now is not v and (hasattr(now, "detach") or now != v):
            group[k] = v
