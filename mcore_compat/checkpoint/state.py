"""What a checkpoint holds of a rank's model chunks, optimizer and RNG, as plain tensors and Python values.

* **model**: each chunk's ``state_dict()`` (the unwrapped module's: no DDP / Float16Module prefix), tensors copied
  to CPU;
* **optimizer**: one record per main param (:mod:`mcore_compat._util.optimizer_view`), keyed by the model param's
  name and the flattened range it covers, with its state (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``); the
  torch optimizers' param-group settings and the grad scalers' state. Keyed by model param, not by Megatron's
  bucket layout, so the same records load into a distributed optimizer of another data-parallel size or into a
  non-distributed one, and on another release whose buckets are laid out differently;
* **rng**: torch's CPU (and CUDA) generator, Python's ``random`` and Megatron's RNG tracker.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from typing import Any

import torch

from .._util.optimizer_view import MainParam, optimizer_view
from ..layout.read import unwrap
from .coords import Coords, is_expert
from .errors import CheckpointError

__all__ = ["PLAIN_TYPES", "capture_rng", "check_plain", "host_copy", "leaves", "main_params", "model_state",
           "named_params", "optimizer_state", "param_key", "restore_rng"]

#: Values ``extra`` may hold (what ``torch.load(weights_only=True)`` reads back), besides dicts, lists and tuples.
PLAIN_TYPES = (str, int, float, bool, type(None), torch.Tensor)


def check_plain(value: Any, where: str = "extra") -> None:
    """Refuse a value that the weights-only loader could not read back (a class instance, a function)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise CheckpointError(f"{where} has a key of type {type(k).__name__}: use str or int keys")
            check_plain(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]")
    elif not isinstance(value, PLAIN_TYPES):
        raise CheckpointError(f"{where} is a {type(value).__name__}: a checkpoint's extra holds tensors, str, int, "
                              "float, bool, None and dicts/lists of them (convert it, e.g. to a dict)")


def _cpu(value: Any) -> Any:
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def host_copy(value: Any) -> Any:
    """``value`` (dicts, lists and tuples of tensors and plain values) with every tensor copied to host memory: the
    caller's ``extra``, which a background save must not see change."""
    if isinstance(value, dict):
        return {k: host_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host_copy(v) for v in value)
    return _cpu(value)


def named_params(chunks: list[Any]) -> dict[Any, str]:
    """``{param: "<chunk>.<qualified name>"}`` of every parameter of the chunks."""
    return {p: f"{i}.{n}" for i, chunk in enumerate(chunks) for n, p in unwrap(chunk).named_parameters()}


def model_state(chunks: list[Any]) -> list[dict[str, Any]]:
    """Each chunk's ``state_dict()`` with its tensors on the CPU."""
    return [{k: _cpu(v) for k, v in unwrap(chunk).state_dict().items()} for chunk in chunks]


def leaves(optimizer: Any) -> list[Any]:
    """The non-chained optimizers of ``optimizer``, in order (a ``ChainedOptimizer``'s members)."""
    out, stack = [], [optimizer]
    while stack:
        opt = stack.pop(0)
        chained = getattr(opt, "chained_optimizers", None)
        if chained is not None:
            stack[:0] = list(chained)
        else:
            out.append(opt)
    return out


def param_key(mp: MainParam, coords: Coords) -> str:
    """The key a main param's records are found by in every shard of the same TP/PP coordinate: its name, and
    for an expert param the expert-parallel rank (expert names are local to it)."""
    return f"{mp.name}@ep{coords.ep}" if is_expert(mp.model) else mp.name


def main_params(chunks: list[Any], optimizer: Any) -> Iterator[MainParam]:
    """The optimizer's main params, named by :func:`named_params`."""
    view = optimizer_view(optimizer, named_params(chunks))
    if view.unsupported is not None:
        raise CheckpointError(f"cannot checkpoint this optimizer: {view.unsupported}")
    yield from view


_SETTINGS = (int, float, bool, str, type(None))


def _group_settings(group: dict[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()
            if k != "params" and (isinstance(v, _SETTINGS)
                                  or (isinstance(v, tuple) and all(isinstance(x, _SETTINGS) for x in v)))}


def optimizer_state(chunks: list[Any], optimizer: Any, coords: Coords) -> dict[str, Any]:
    """The optimizer's records (see the module docstring)."""
    view = optimizer_view(optimizer, named_params(chunks))
    if view.unsupported is not None:
        raise CheckpointError(f"cannot checkpoint this optimizer: {view.unsupported}")
    records = []
    for mp in view:
        state = mp.inner.state.get(mp.main, {})
        records.append({"key": param_key(mp, coords), "numel": mp.model.numel(),
                        "start": mp.start, "end": mp.end, "main": _cpu(mp.main),
                        "state": {k: _cpu(v) for k, v in state.items()}})
    scalers = [getattr(leaf, "grad_scaler", None) for leaf in leaves(optimizer)]
    return {"params": records,
            "groups": [[_group_settings(g) for g in inner.param_groups] for inner in view.inner],
            "grad_scalers": [None if s is None else {k: _cpu(v) for k, v in s.state_dict().items()}
                             for s in scalers]}


def _tracker() -> Any:
    import importlib

    return importlib.import_module("megatron.core.tensor_parallel.random").get_cuda_rng_tracker()


def capture_rng() -> dict[str, Any]:
    """This process's RNG states: torch CPU, CUDA (every device), Python's ``random``, Megatron's tracker."""
    py = random.getstate()
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [py[0], list(py[1]), py[2]],
                           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                           "tracker": {}}
    if "megatron.core.tensor_parallel.random" in sys.modules:  # not imported: its tracker holds no state
        out["tracker"] = {k: _cpu(v) for k, v in _tracker().get_states().items()}
    return out


def restore_rng(state: dict[str, Any]) -> None:
    """Set the RNG states :func:`capture_rng` recorded."""
    torch.set_rng_state(state["torch"])
    version, inner, gauss = state["python"]
    random.setstate((version, tuple(inner), gauss))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if state["tracker"]:
        _tracker().set_states(dict(state["tracker"]))
