"""What a Megatron ``dist_checkpointing`` directory holds, read without Megatron: ``metadata.json`` (the backend),
``common.pt`` (everything not sharded: ``iteration``, ``checkpoint_version``, ``opt_param_scheduler``, the
optimizer's plain parts) and torch-DCP's ``.metadata`` (each sharded tensor's key, global shape and dtype).

Megatron-LM's trainer (``megatron/training/checkpointing.py``) saves ``{"model": ...}`` (``model0``, ``model1``, ...
with virtual pipeline stages), ``optimizer``, ``opt_param_scheduler``, ``rng_state``, ``iteration``, ``args`` and
``checkpoint_version`` through ``megatron.core.dist_checkpointing.save``; the sharded tensors' keys carry no
``model`` prefix (``decoder.layers.self_attention.linear_qkv.weight``), the optimizer's start with ``optimizer.``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointFormatError
from .manifest import MANIFEST

__all__ = ["COMMON", "METADATA", "TORCH_DIST", "is_megatron_checkpoint", "optimizer_format", "read_common",
           "read_metadata", "read_tensors", "safe_globals", "scheduler_state"]

METADATA = "metadata.json"  # megatron/core/dist_checkpointing/core.py (CheckpointingConfig), every release
COMMON = "common.pt"
TORCH_DIST = "torch_dist"  # the backend of megatron/core/dist_checkpointing/strategies/torch.py (0.6+)


def is_megatron_checkpoint(root: Path) -> bool:
    """``root`` has Megatron's ``metadata.json`` and no mcore_compat manifest."""
    return (root / METADATA).is_file() and not (root / MANIFEST).exists()


def read_metadata(root: Path) -> dict[str, Any]:
    """``metadata.json``: ``sharded_backend``, ``sharded_backend_version`` (and before 0.19 the common backend).

    Raises:
        CheckpointFormatError: not JSON, or no ``sharded_backend`` (a truncated or foreign file).
    """
    path = root / METADATA
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointFormatError(f"{path} cannot be read as Megatron's dist_checkpointing metadata "
                                    f"({type(exc).__name__}: {exc}): truncated or corrupt; copy the checkpoint "
                                    "again") from None
    if not isinstance(data, dict) or not isinstance(data.get("sharded_backend"), str):
        raise CheckpointFormatError(f"{path} names no sharded_backend: not a Megatron dist_checkpointing "
                                    "directory (nor an mcore_compat checkpoint: no mcore_compat_checkpoint.json)")
    return data


def _allowed() -> list[Any]:
    """The classes Megatron-LM's ``common.pt`` holds beyond plain data (``args``: a Namespace; numpy RNG
    states), as Megatron allow-lists them itself from 0.14 (``megatron/core/safe_globals.py``)."""
    import numpy

    out: list[Any] = [argparse.Namespace, types.SimpleNamespace, numpy.ndarray, numpy.dtype]
    core = getattr(numpy, "_core", None) or getattr(numpy, "core", None)
    reconstruct = getattr(getattr(core, "multiarray", None), "_reconstruct", None)
    if reconstruct is not None:
        out.append(reconstruct)
    out.extend(getattr(numpy.dtypes, n) for n in ("UInt32DType", "Float64DType", "Int64DType")
               if hasattr(getattr(numpy, "dtypes", None), n))
    return out


@contextlib.contextmanager
def safe_globals() -> Iterator[None]:
    """torch's weights-only unpickler accepts :func:`_allowed` meanwhile (Megatron 0.8-0.11 and 0.14+ read
    ``common.pt`` with torch's default, weights-only on torch >= 2.6)."""
    ctx = getattr(torch.serialization, "safe_globals", None)
    if ctx is None:
        yield
        return
    with ctx(_allowed()):
        yield


def read_common(root: Path) -> dict[str, Any]:
    """``common.pt`` (weights-only, with :func:`safe_globals`); ``{}`` when the directory has none.

    Raises:
        CheckpointFormatError: it cannot be read.
    """
    path = root / COMMON
    if not path.exists():
        return {}
    try:
        with safe_globals():
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointFormatError(f"{path} cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0]}): "
                                    "truncated, corrupt or holding objects outside torch's weights-only "
                                    "allow-list") from None
    if not isinstance(data, dict):
        raise CheckpointFormatError(f"{path} holds a {type(data).__name__}, not Megatron's common state dict")
    return data


def read_tensors(root: Path) -> dict[str, dict[str, Any]]:
    """Each sharded entry of torch-DCP's ``.metadata``: ``{key: {"shape": [...], "dtype": str}}`` for tensors,
    ``{key: {"object": True}}`` for Megatron's ``ShardedObject`` entries (``<key>/shard_<offset>_<shape>``).

    Raises:
        CheckpointFormatError: no readable ``.metadata`` (an unfinished save, or another backend).
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        md = FileSystemReader(str(root)).read_metadata()
    except Exception as exc:
        raise CheckpointFormatError(f"{root}/.metadata cannot be read ({type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0] if str(exc) else ''}): an unfinished save or a "
                                    "truncated copy") from None
    out: dict[str, dict[str, Any]] = {}
    for key, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            out[key] = {"shape": list(item.size), "dtype": str(item.properties.dtype).replace("torch.", "")}
        else:
            out[key] = {"object": True}
    return out


def scheduler_state(common: dict[str, Any]) -> dict[str, Any] | None:
    """The scheduler's state in ``common.pt``: ``opt_param_scheduler``, or ``lr_scheduler`` as older Megatron-LM
    checkpoints name it (``megatron/training/checkpointing.py`` reads both); ``None`` if neither."""
    for key in ("opt_param_scheduler", "lr_scheduler"):
        if isinstance(common.get(key), dict):
            return dict(common[key])
    return None


def optimizer_format(common: dict[str, Any], tensors: dict[str, dict[str, Any]]) -> str | None:
    """The optimizer state's format: the distributed optimizer's ``param_state_sharding_type`` when
    ``common.pt`` records it (``optimizer/distrib_optimizer.py``), else read from the keys; ``None``: no
    optimizer state."""
    opt = common.get("optimizer")
    keys = [k for k in tensors if k.startswith("optimizer.")]
    if isinstance(opt, dict):
        for inner in [opt, *(v for k, v in opt.items() if k.startswith("chained_") and isinstance(v, dict))]:
            kind = inner.get("param_state_sharding_type")
            if isinstance(kind, str):
                return f"distributed optimizer, {kind}"
    if not keys and not isinstance(opt, dict):
        return None
    if any(".distributed." in k for k in keys):
        return "distributed optimizer, bucket space (optimizer.distributed.*)"
    if any(k.startswith("optimizer.state.fp32_param.") for k in keys):
        return "per-parameter fp32_param/exp_avg/exp_avg_sq (model space)"
    if any(k.startswith("optimizer.state.param.") for k in keys):
        return "distributed optimizer, fully_reshardable"
    if any(k.startswith("optimizer.state.") for k in keys):
        return "per-parameter exp_avg/exp_avg_sq (fp32 optimizer)"
    return "optimizer state in common.pt only"
