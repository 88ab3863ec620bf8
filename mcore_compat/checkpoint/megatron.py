"""Loading a checkpoint Megatron-LM wrote (``megatron.core.dist_checkpointing``, ``torch_dist`` backend) into
model chunks, through Megatron's own ``dist_checkpointing.load`` with the chunks' ``sharded_state_dict()``, so
Megatron does any TP / PP / DP resharding.

Like :func:`~.load.load_checkpoint`: every rank plans (the release can read the backend, every tensor the model
asks for is in the checkpoint at its global shape and dtype, the optimizer is not asked for), the ranks agree,
Megatron reads the values into fresh tensors (never into the model's), they are checked against the model, the
ranks agree again, and only then are they copied in. A refusal anywhere leaves every rank's model as it was.

Loaded: the model weights (and layers' extra state), ``iteration``, ``checkpoint_version`` and the scheduler
(``opt_param_scheduler``). Refused: the optimizer state (its formats differ by release and drop values on some,
see docs/checkpoints.md) and the ``zarr`` backend; the RNG states are not restored.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..layout.read import unwrap
from .coords import Coords
from .errors import CheckpointError, CheckpointFormatError, CheckpointMismatchError
from .megatron_files import (
    TORCH_DIST,
    optimizer_format,
    read_common,
    read_metadata,
    read_tensors,
    safe_globals,
    scheduler_state,
)
from .outcome import LoadedCheckpoint, _agree

__all__ = ["LoadedMegatronCheckpoint", "load_megatron", "model_keys", "unsupported_reason"]


@dataclass(frozen=True)
class LoadedMegatronCheckpoint(LoadedCheckpoint):
    """What :func:`load_megatron` loaded (``manifest`` is ``None``: there is no mcore_compat manifest).

    Attributes:
        checkpoint_version: Megatron-LM's ``checkpoint_version`` in ``common.pt`` (``None`` if absent).
        scheduler_loaded: the scheduler was loaded from ``opt_param_scheduler`` (or the older ``lr_scheduler``).
        metadata: ``metadata.json`` (backend and its version).
    """

    checkpoint_version: float | None = None
    scheduler_loaded: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)


def unsupported_reason() -> str | None:
    """Why this release cannot load a torch_dist checkpoint (``None``: it can)."""
    import importlib.util

    from ..capabilities import has
    from ..detect import detect

    version = detect().version
    if not has("dist_ckpt_torch_dist"):
        return (f"megatron-core {version}'s dist_checkpointing has no torch_dist backend (it comes with "
                "dist_checkpointing/strategies/torch.py in 0.6)")
    if has("dist_ckpt_imports_psutil") and importlib.util.find_spec("psutil") is None:
        return (f"megatron-core {version}'s torch_dist strategy imports psutil "
                "(dist_checkpointing/strategies/filesystem_async.py), which is not installed: pip install psutil")
    return None


def model_keys(n_chunks: int) -> list[str]:
    """Megatron-LM's keys of the model chunks in its state dict: ``model``, or ``model0``, ``model1``, ... with
    virtual pipeline stages (``megatron/training/checkpointing.py``)."""
    return ["model"] if n_chunks == 1 else [f"model{i}" for i in range(n_chunks)]


@contextlib.contextmanager
def _virtual_stage(index: int, n_chunks: int) -> Iterator[None]:
    """Chunk ``index``'s virtual pipeline rank set in ``parallel_state`` meanwhile, as Megatron-LM sets it around
    each ``model[i].sharded_state_dict()`` (``megatron/training/checkpointing.py``; older releases' blocks read
    their layer offset from it there)."""
    if n_chunks == 1:
        yield
        return
    from ..training._common import parallel_state

    ps = parallel_state()
    before = ps.get_virtual_pipeline_model_parallel_rank()
    ps.set_virtual_pipeline_model_parallel_rank(index)
    try:
        yield
    finally:
        ps.set_virtual_pipeline_model_parallel_rank(before)


def _fresh_requests(sharded: Any, classes: tuple[type, ...]) -> list[Any]:
    """Point every ShardedTensor (and factory) of ``sharded`` at a fresh empty tensor, so that Megatron reads into
    those and not into the model's params; the ShardedTensors."""
    found: list[Any] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, classes) and isinstance(data := getattr(node, "data", None), torch.Tensor):
            object.__setattr__(node, "data", torch.empty_like(data))  # Megatron reads into this one
            if type(node).__name__ == "ShardedTensor":
                found.append(node)

    walk(sharded)
    return found


def _check_requests(root: Path, requests: list[Any], saved: dict[str, dict[str, Any]]) -> None:
    """Every tensor the model asks for is in the checkpoint at the same global shape and dtype."""
    for sh in requests:
        have = saved.get(sh.key)
        want_shape, want_dtype = list(sh.global_shape), str(sh.dtype).replace("torch.", "")
        if have is None or "shape" not in have:
            near = sorted(k for k in saved if not k.startswith("optimizer.") and "/shard_" not in k)
            raise CheckpointMismatchError(
                f"{sh.key}: not in {root} (its model tensors: {near[:4]}{' ...' if len(near) > 4 else ''}); another "
                "model configuration, or a checkpoint saved with other sharded keys")
        if have["shape"] != want_shape or have["dtype"] != want_dtype:
            raise CheckpointMismatchError(
                f"{sh.key}: the checkpoint has {have['dtype']} {tuple(have['shape'])}, the model {want_dtype} "
                f"{tuple(want_shape)} (global shapes; another model configuration or dtype)")


@dataclass
class _Plan:
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    extra_states: list[tuple[torch.nn.Module, dict[str, Any]]] = field(default_factory=list)

    def apply(self) -> None:
        with torch.no_grad():
            for dest, src in self.copies:
                dest.copy_(src)
        for module, state in self.extra_states:
            module.load_state_dict(state, strict=False)


def _plan_copies(chunks: list[Any], loaded: dict[str, Any], strict: bool) -> _Plan:
    plan = _Plan()
    for i, (chunk, key) in enumerate(zip(chunks, model_keys(len(chunks)), strict=True)):
        module = unwrap(chunk)
        target = module.state_dict(keep_vars=True)
        got = loaded.get(key)
        if not isinstance(got, dict):
            raise CheckpointFormatError(f"Megatron's load returned no {key!r} state for chunk {i}")
        tensors = {k for k, v in target.items() if isinstance(v, torch.Tensor)}
        missing = sorted(tensors - {k for k, v in got.items() if isinstance(v, torch.Tensor)})
        if strict and missing:
            raise CheckpointMismatchError(f"chunk {i}: {missing[:4]} not loaded from the checkpoint (strict=False "
                                          "loads the tensors both have)")
        extra: dict[str, Any] = {}
        for name, value in got.items():
            dest = target.get(name)
            if not isinstance(value, torch.Tensor):
                if name.endswith("_extra_state"):
                    extra[name] = value
                continue
            if not isinstance(dest, torch.Tensor):
                if strict:
                    raise CheckpointMismatchError(f"chunk {i}: {name} loaded but not in the model")
                continue
            if dest.shape != value.shape or dest.dtype != value.dtype:
                raise CheckpointMismatchError(f"chunk {i} {name}: loaded {value.dtype} {tuple(value.shape)}, the "
                                              f"model has {dest.dtype} {tuple(dest.shape)}")
            plan.copies.append((dest.detach(), value))
        if extra:
            plan.extra_states.append((module, extra))
    return plan


def _plan_before_load(root: Path, chunks: list[Any], optimizer: Any, scheduler: Any,
                      strict: bool) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Everything decided before Megatron reads a value: ``(metadata, common, request)``."""
    metadata = read_metadata(root)
    backend = metadata["sharded_backend"]
    if backend != TORCH_DIST:
        raise CheckpointFormatError(
            f"{root} was saved with Megatron's {backend!r} dist_checkpointing backend; mcore_compat loads "
            f"{TORCH_DIST!r} only: convert it with Megatron's dist_checkpointing (load it, save it with the "
            f"{TORCH_DIST} strategy)")
    why = unsupported_reason()
    if why is not None:
        raise CheckpointError(f"{root} is a Megatron dist_checkpointing checkpoint; {why}")
    common = read_common(root)
    saved = read_tensors(root)
    if optimizer is not None:
        kind = optimizer_format(common, saved)
        what = f"its optimizer state ({kind})" if kind else "it holds no optimizer state, and"
        raise CheckpointError(
            f"{root} is a Megatron dist_checkpointing checkpoint; {what} mcore_compat does not load Megatron's "
            "optimizer formats (they drop or reset state on some releases): load weights only: optimizer=None")
    if scheduler is not None and strict and scheduler_state(common) is None:
        raise CheckpointMismatchError(f"{root} holds no opt_param_scheduler state (load with scheduler=None)")
    # imported by name: the unit session (no Megatron) resolves the function-local `from` imports of every module
    mapping = importlib.import_module("megatron.core.dist_checkpointing.mapping")
    classes: tuple[type, ...] = (mapping.ShardedTensor,)
    factory = getattr(mapping, "ShardedTensorFactory", None)
    if factory is not None:
        classes += (factory,)
    request: dict[str, Any] = {}
    for i, (key, chunk) in enumerate(zip(model_keys(len(chunks)), chunks, strict=True)):
        module: Any = unwrap(chunk)
        with _virtual_stage(i, len(chunks)):
            request[key] = module.sharded_state_dict()
        tensors = _fresh_requests(request[key], classes)
        if not strict:
            keep = {sh.key for sh in tensors if sh.key in saved}
            request[key] = _drop(request[key], classes, keep)
            tensors = [sh for sh in tensors if sh.key in keep]
        _check_requests(root, tensors, saved)
    return metadata, common, request


def _drop(node: Any, classes: tuple[type, ...], keep: set[str]) -> Any:
    """``node`` without the ShardedTensors whose key is not in ``keep``."""
    if isinstance(node, dict):
        return {k: _drop(v, classes, keep) for k, v in node.items()
                if not (type(v).__name__ == "ShardedTensor" and v.key not in keep)}
    return node


def _first_line(exc: BaseException) -> str:
    """``"<type>: <first line>"`` of ``exc``, or of the first rank's failure a torch-DCP ``CheckpointException``
    wraps (its ``failures``: rank -> wrapped exception)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        wrapped = next(iter(failures.values()))
        exc = getattr(wrapped, "exc", wrapped) if isinstance(getattr(wrapped, "exc", wrapped), BaseException) else exc
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def _run(fn: Any, where: Coords, what: str) -> Any:
    """``fn()`` on every rank, then every rank's outcome agreed (a refusal anywhere is raised everywhere); ``what``
    names the step in the refusal of an unexpected error."""
    try:
        out = fn()
    except CheckpointError as exc:
        _agree((type(exc).__name__, str(exc), where.rank))
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # e.g. Megatron's own load failing (torch's CheckpointException is a BaseException)
        text = f"{what} failed: {_first_line(exc)}"
        _agree(("CheckpointFormatError", text, where.rank))
        raise CheckpointFormatError(text) from None
    _agree(None)
    return out


def load_megatron(root: Path, chunks: list[Any], optimizer: Any, scheduler: Any, strict: bool,
                  where: Coords) -> LoadedMegatronCheckpoint:
    """Load the model weights (and scheduler, iteration) of Megatron dist_checkpointing directory ``root`` into
    ``chunks``; see :func:`~.load.load_checkpoint` (which calls it for such a directory) for the arguments."""
    metadata, common, request = _run(lambda: _plan_before_load(root, chunks, optimizer, scheduler, strict), where,
                                     "planning the load of a Megatron checkpoint (the chunks' sharded_state_dict)")
    dist_checkpointing = importlib.import_module("megatron.core.dist_checkpointing")

    def read() -> dict[str, Any]:
        with safe_globals():
            return dist_checkpointing.load(request, str(root))

    loaded = _run(read, where, "Megatron's dist_checkpointing.load")
    plan = _run(lambda: _plan_copies(chunks, loaded, strict), where, "checking the loaded values")
    sched_state = scheduler_state(common) if scheduler is not None else None
    before = scheduler.state_dict() if isinstance(sched_state, dict) else None

    def load_scheduler() -> None:
        if isinstance(sched_state, dict):
            try:
                scheduler.load_state_dict(sched_state)
            except Exception as exc:  # put back below, with a refusal on any other rank
                raise CheckpointMismatchError(f"the scheduler refused the checkpoint's opt_param_scheduler: "
                                              f"{exc}") from None

    try:
        _run(load_scheduler, where, "loading the scheduler")
    except CheckpointError:
        if before is not None:
            scheduler.load_state_dict(before)
        raise
    plan.apply()
    version = common.get("checkpoint_version")
    iteration = common.get("iteration")
    return LoadedMegatronCheckpoint(
        iteration=int(iteration) if isinstance(iteration, int) else None, extra=None, manifest=None,
        rng_restored=False, optimizer_loaded=False,
        checkpoint_version=float(version) if isinstance(version, (int, float)) else None,
        scheduler_loaded=isinstance(sched_state, dict), metadata=metadata)
