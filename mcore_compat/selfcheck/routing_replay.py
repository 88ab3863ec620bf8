"""Replaying the real step's MoE routing choices into the float64 copy, so that both compute the same function.

A MoE router picks each token's experts with ``torch.topk`` (``Tensor.topk`` for group-limited routing): a
choice, not a smooth function of the params. The float64 copy of the model (:mod:`.directional`) differs from
the model in its rounding, so where two experts' scores are within the model dtype's rounding of each other (bf16:
about 1e-2 relative; many tokens of a real batch are) the copy would route a token to another expert than the
real step did, and its loss, its gradient and its finite differences would belong to another function. The same
holds for the copy's own perturbed forwards: a step of ``h`` along a direction can flip a near-tied choice, and a
central difference across a flip measures the jump, not the derivative.

:class:`RoutingReplay` records, while the real step's ``forward_step_func`` runs each (chunk, micro-batch), the
indices every ``topk`` call inside a router module returns (modules whose class name ends in ``Router``: Megatron's
``TopKRouter`` 0.5+, transformer/moe/router.py; its ``topk`` calls live in router.py 0.5-0.7 and in
moe_utils.py's ``topk_softmax_with_capacity`` 0.8+, including the capacity drop's ``topk``). :meth:`replaying`
makes a module's router forwards return those indices, in the same order, with the values gathered from the
copy's own scores (differentiable, the copy's dtype): the routing is held at the real step's choice, around which
the loss is smooth. A call the record does not have, or whose shape differs, is counted in :attr:`missed` and
answered by the real ``topk`` (the caller then reports the check not applicable).

Recompute of activations in the backward runs the router again outside ``forward_step_func``: not recorded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["RoutingReplay", "routers"]


def routers(module: Any) -> list[Any]:
    """The router modules inside ``module`` (class name ending in ``Router``)."""
    return [m for m in module.modules() if type(m).__name__.endswith("Router")]


class _Topk:
    """``torch.topk`` and ``Tensor.topk`` replaced while a router's forward runs (depth-counted: nested routers
    count once); ``on_call(real, input, k, dim, args, kwargs)`` answers each call."""

    def __init__(self, on_call: Callable[..., Any]) -> None:
        self.on_call = on_call
        self.depth = 0
        self._saved: tuple[Any, Any] | None = None

    def enter(self, _module: Any, _args: Any) -> None:
        import torch

        self.depth += 1
        if self.depth > 1:
            return
        real_fn, real_method = torch.topk, torch.Tensor.topk
        self._saved = (real_fn, real_method)

        def topk(input: Any, k: int, dim: int = -1, *args: Any, **kwargs: Any) -> Any:
            return self.on_call(real_fn, input, k, dim, args, kwargs)

        def method(input: Any, k: int, dim: int = -1, *args: Any, **kwargs: Any) -> Any:
            return self.on_call(real_method, input, k, dim, args, kwargs)

        torch.topk = topk  # type: ignore[assignment]
        torch.Tensor.topk = method  # type: ignore[assignment,method-assign]

    def leave(self, *_: Any) -> None:
        import torch

        self.depth = max(0, self.depth - 1)
        if self.depth == 0 and self._saved is not None:
            torch.topk, torch.Tensor.topk = self._saved  # type: ignore[method-assign]
            self._saved = None

    @contextlib.contextmanager
    def on(self, module: Any) -> Iterator[None]:
        """The replacement active inside every router forward of ``module`` for the duration."""
        handles = []
        for m in routers(module):
            handles.append(m.register_forward_pre_hook(self.enter))
            handles.append(m.register_forward_hook(self.leave))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            while self.depth:
                self.leave()


class RoutingReplay:
    """The real step's routing choices per (chunk, micro-batch), replayed into another module's forward.

    Args:
        chunks: the model chunks of this rank (as the schedule gets them), to tell which one a forward runs.
    """

    def __init__(self, chunks: Sequence[Any]) -> None:
        from .wrappers import core_module

        self._cores = [core_module(c) for c in chunks]
        self._index = {id(c): i for i, c in enumerate(self._cores)}
        self.active = any(routers(c) for c in self._cores)
        self.choices: dict[tuple[int, int], list[Any]] = {}
        self._counts: dict[int, int] = {}
        self.missed: list[str] = []

    def start_step(self) -> None:
        """Forget the previous step's choices."""
        self.choices.clear()
        self._counts.clear()
        self.missed.clear()

    def _chunk_of(self, model: Any) -> int | None:
        from .wrappers import core_module

        index = self._index.get(id(core_module(model)))
        return 0 if index is None and len(self._cores) == 1 else index

    def recording(self, forward_step_func: Callable[..., Any]) -> Callable[..., Any]:
        """``forward_step_func`` for the real step: every router ``topk`` of its forward is recorded."""
        if not self.active:
            return forward_step_func

        def forward_step(data_iterator: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
            chunk = self._chunk_of(model)
            if chunk is None:
                return forward_step_func(data_iterator, model, *args, **kwargs)
            mb = self._counts.get(chunk, 0)
            self._counts[chunk] = mb + 1
            got: list[Any] = []
            self.choices[(chunk, mb)] = got

            def record(real: Any, input: Any, k: int, dim: int, a: Any, kw: Any) -> Any:
                out = real(input, k, dim, *a, **kw)
                got.append(out[1].detach().clone())
                return out

            with _Topk(record).on(self._cores[chunk]):
                return forward_step_func(data_iterator, model, *args, **kwargs)

        return forward_step

    @contextlib.contextmanager
    def replaying(self, module: Any, chunk: int, microbatch: int) -> Iterator[None]:
        """Within: ``module``'s router ``topk`` calls return the recorded choices of (``chunk``, ``microbatch``)
        in order (values gathered from the scores they are given)."""
        if not self.active:
            yield
            return
        import torch

        queue = list(self.choices.get((chunk, microbatch), []))
        where = f"chunk {chunk}, micro-batch {microbatch}"

        def replay(real: Any, input: Any, k: int, dim: int, a: Any, kw: Any) -> Any:
            if not queue:
                self.missed.append(f"{where}: a router topk the real step did not make")
                return real(input, k, dim, *a, **kw)
            idx = queue.pop(0)
            shape = list(input.shape)
            shape[dim] = k
            if list(idx.shape) != shape:
                self.missed.append(f"{where}: a router topk of shape {shape} where the real step's was "
                                   f"{list(idx.shape)}")
                return real(input, k, dim, *a, **kw)
            idx = idx.to(input.device)
            values = input.gather(dim, idx)
            return torch.return_types.topk((values, idx))

        with _Topk(replay).on(module):
            yield
        if queue:
            self.missed.append(f"{where}: {len(queue)} router topk call(s) of the real step not made")
