"""Replaying the real step's random streams into the gradient reference, so that dropout draws the same masks.

With dropout on, the reference (:mod:`.reference`) reproduces the step's gradients only if each of its forwards
draws the same masks as the real forward of the same model chunk and micro-batch. :class:`RngReplay` records, right
before the real step calls ``forward_step_func`` for a (chunk, micro-batch), every generator a forward can draw
from:

* torch's CPU default generator (``torch.get_rng_state()``);
* the CUDA default generator of the current device, when CUDA is in use (``torch.cuda.get_rng_state()``);
* Megatron's model-parallel RNG tracker (``tensor_parallel.random.get_cuda_rng_tracker()``: ``get_states`` /
  ``set_states``, the same API in every release 0.4 ... 0.19); the dropout inside ``tracker.fork()`` (sequence
  parallelism, attention without it) draws from its states. With mcore_compat's CPU patches the tracker's states
  are CPU generator states; with ``use_cudagraphable_rng`` they are ``torch.Generator`` objects, copied with
  ``clone_state`` and restored into the tracker's own generators with ``graphsafe_set_state``.

The reference restores that snapshot before its forward of the same (chunk, micro-batch) and, when it is done,
the state the real step left: checking a step does not change the random streams of the training that follows.

Replay cannot reach a generator outside these: TransformerEngine's attention with dropout draws its masks inside
its fused kernels (:func:`unreplayable_reason` says so, and the gradient check is then not applicable).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["RngReplay", "RngState", "capture", "restore", "unreplayable_reason"]


def _tracker() -> Any:
    """Megatron's model-parallel RNG tracker (``None`` where it cannot be had)."""
    try:
        random = importlib.import_module("megatron.core.tensor_parallel.random")
        return random.get_cuda_rng_tracker()
    except (ImportError, AttributeError):
        return None


def _cuda_in_use() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_initialized())


def _copy(state: Any) -> Any:
    import torch

    if isinstance(state, torch.Generator):
        return state.clone_state()
    return state.clone() if isinstance(state, torch.Tensor) else state


@dataclass
class RngState:
    """A copy of every generator a forward can draw from (see the module docstring)."""

    cpu: Any
    cuda: Any = None
    tracker: dict[str, Any] | None = None

    def same_as(self, other: RngState) -> bool:
        """Whether both hold the same states (for tests: the streams continue as without the check)."""
        import torch

        def eq(a: Any, b: Any) -> bool:
            if isinstance(a, torch.Generator) and isinstance(b, torch.Generator):
                return bool(torch.equal(a.get_state(), b.get_state()))
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
                return bool(torch.equal(a, b))
            return a is None and b is None

        if not eq(self.cpu, other.cpu) or not eq(self.cuda, other.cuda):
            return False
        mine, theirs = self.tracker or {}, other.tracker or {}
        return mine.keys() == theirs.keys() and all(eq(mine[k], theirs[k]) for k in mine)


def capture() -> RngState:
    """The current state of every generator (copies: later draws do not change it)."""
    import torch

    tracker = _tracker()
    states = None
    if tracker is not None and hasattr(tracker, "get_states"):
        states = {name: _copy(s) for name, s in tracker.get_states().items()}
    return RngState(cpu=torch.get_rng_state(), cuda=torch.cuda.get_rng_state() if _cuda_in_use() else None,
                    tracker=states)


def restore(state: RngState) -> None:
    """Set every generator to ``state`` (which stays usable for another restore)."""
    import torch

    torch.set_rng_state(state.cpu)
    if state.cuda is not None:
        torch.cuda.set_rng_state(state.cuda)
    tracker = _tracker()
    if state.tracker is None or tracker is None or not hasattr(tracker, "set_states"):
        return
    live = tracker.get_states()
    states: dict[str, Any] = {}
    for name, saved in state.tracker.items():
        current = live.get(name)
        if isinstance(saved, torch.Generator) and isinstance(current, torch.Generator):
            current.graphsafe_set_state(saved)  # the generator the tracker (and a captured graph) already holds
            states[name] = current
        else:
            states[name] = _copy(saved)
    tracker.set_states(states)


class RngReplay:
    """Records the generators' state before each micro-batch's forward of the real step, per model chunk, and
    restores it before the reference's forward of the same (chunk, micro-batch).

    Args:
        chunks: the model chunks of this rank (as the schedule gets them), to tell which one a forward runs.
    """

    def __init__(self, chunks: Sequence[Any]) -> None:
        from .wrappers import core_module

        self._index = {id(core_module(c)): i for i, c in enumerate(chunks)}
        self._single = len(chunks) == 1
        self.states: dict[tuple[int, int], RngState] = {}
        self._counts: dict[int, int] = {}

    def start_step(self) -> None:
        """Forget the previous step's states."""
        self.states.clear()
        self._counts.clear()

    def chunk_of(self, model: Any) -> int | None:
        """The index of the chunk ``model`` is (or wraps), ``None`` if none."""
        from .wrappers import core_module

        index = self._index.get(id(core_module(model)))
        return 0 if index is None and self._single else index

    def recording(self, forward_step_func: Callable[..., Any]) -> Callable[..., Any]:
        """``forward_step_func`` for the real step: records the state, then runs the caller's function."""

        def forward_step(data_iterator: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
            chunk = self.chunk_of(model)
            if chunk is not None:
                mb = self._counts.get(chunk, 0)
                self._counts[chunk] = mb + 1
                self.states[(chunk, mb)] = capture()
            return forward_step_func(data_iterator, model, *args, **kwargs)

        return forward_step

    def replay(self, chunk: int, microbatch: int) -> bool:
        """Restore the state recorded before the real forward of (``chunk``, ``microbatch``); ``False``: none."""
        state = self.states.get((chunk, microbatch))
        if state is None:
            return False
        restore(state)
        return True


def _dropout(config: Any, name: str) -> float:
    value = getattr(config, name, 0.0)
    return float(value) if isinstance(value, (int, float)) else 0.0


def unreplayable_reason(chunks: Sequence[Any]) -> str | None:
    """Why replaying the generators cannot reproduce the step's dropout masks (``None``: it can).

    TransformerEngine's attention (Megatron's ``TEDotProductAttention``) with attention dropout draws its mask
    inside TransformerEngine's fused kernels, from state :func:`capture` does not see.
    """
    for chunk in chunks:
        for module in chunk.modules():
            cls = type(module)
            where = cls.__module__
            if "transformer_engine" not in where or "DotProductAttention" not in cls.__name__:
                continue
            config = getattr(module, "config", None)
            p = _dropout(config, "attention_dropout") if config is not None else 0.0
            p = max(p, _dropout(module, "attention_dropout"))
            if p > 0:
                return (f"attention dropout {p:g} in TransformerEngine's {cls.__name__}: its fused kernels draw the "
                        f"mask from their own generator state, which the reference cannot replay")
    return None
